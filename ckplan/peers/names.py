"""The peers' names, as ``--compare`` takes them, and the status of a peer row that cannot run here.

``PEER_NAMES`` run the model eagerly with the peer's checkpointing or offload; ``COMPILE_PEERS``
compile it with ``torch.compile`` (:mod:`ckplan.peers.torch_compile`).
"""
from __future__ import annotations

PEER_NAMES: tuple[str, ...] = ("hf", "sac-policy", "offload-all", "offload-attn")
COMPILE_PEERS: tuple[str, ...] = ("torch-compile", "torch-compile-nobudget")
UNAVAILABLE = "unavailable"
