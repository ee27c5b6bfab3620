"""What a compiled training step holds for its backward, read from TorchInductor's partitioned graphs.

When TorchInductor compiles a training graph, its min-cut partitioner splits the joint graph into a
forward and a backward; the values the forward saves are the forward's outputs that are the
backward's inputs. ``SavedForBackward`` records their bytes while it is active, by the chain layer
whose op made each value (its ``nn_module_stack``), ``inputs`` (the graph's own inputs: weights and
the batch, which exist anyway) and ``other`` (ops outside the chain: embeddings, the loss head).
Views of one buffer count once. This is what the compiled step holds after its forward, with
selective-checkpoint regions and ``activation_memory_budget`` honoured, known before the step
runs: on CPU (gpt2-small and a tiny GPT, torch 2.13) the sum less ``inputs`` equals the bytes held
after the forward measured from the allocator's events to within 4 bytes
(``reports/cpu/compiled-regions``), compiled as ckplan's compiled rows are (random ops drawn as
eager: ``ckplan.peers.eager_random_ops``). Without that, checkpoint regions with random ops also
hold generator states outside the graph (about 5 KB per region on CPU).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

_INDEX = re.compile(r"\[(\d+)\]")
_KEY = re.compile(r"\[['\"]([^'\"]+)['\"]\]")


def _storage(val: Any) -> int | None:
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def module_path(stack_path: str) -> str:
    """A dotted module name from Dynamo's ``nn_module_stack`` path
    (``L['self'].blocks[3]``, ``L['self']._modules['blocks']._modules['3']``,
    ``L['args'][0].blocks.3``) -> ``blocks.3``."""
    path = _INDEX.sub(r".\1", _KEY.sub(r".\1", str(stack_path)))
    parts = [p for p in path.split(".") if p and p != "_modules"]
    if parts and parts[0] in ("L", "self", "G"):
        parts = parts[1:]
    if parts[:2] == ["args", "0"]:  # the module itself, passed as the traced frame's first argument
        parts = parts[2:]
    if parts and parts[0] in ("self", "fn", "mod", "_orig_mod"):
        parts = parts[1:]
    return ".".join(p for p in parts if p != "_orig_mod")


class SavedForBackward:
    """While active, each TorchInductor training compile adds what its forward saves to ``bytes``:
    ``{"L<i>": ..., "inputs": ..., "other": ...}`` with ``i`` the index in ``layer_names`` (the
    chain layers' qualified names in the compiled module) of the layer that made the value."""

    def __init__(self, layer_names: Sequence[str]):
        self.layer_names = list(layer_names)
        self.bytes: dict[str, int] = {}
        self._original: Any = None
        self._module: Any = None  # torch._inductor.compile_fx, once entered

    def __enter__(self) -> SavedForBackward:
        import torch._inductor.compile_fx as cfx  # the compiler loads on first use only
        self._module = cfx
        self._original = original = cfx.min_cut_rematerialization_partition

        def partition(joint, *args, **kwargs):
            fw, bw = original(joint, *args, **kwargs)
            self._count(fw, bw)
            return fw, bw

        cfx.min_cut_rematerialization_partition = partition
        return self

    def __exit__(self, *exc) -> None:
        self._module.min_cut_rematerialization_partition = self._original

    def _count(self, fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> None:
        wanted = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
        out = next(n for n in fw.graph.nodes if n.op == "output")
        # a view of an input (a transposed weight) is the input's memory, not new memory
        inputs = {_storage(n.meta.get("val")) for n in fw.graph.nodes if n.op == "placeholder"}
        seen: set[int] = set()
        for node in dict.fromkeys(a for a in out.args[0] if isinstance(a, torch.fx.Node)):
            val = node.meta.get("val")
            if node.name not in wanted or not isinstance(val, torch.Tensor):
                continue
            storage = _storage(val)
            if storage in seen:
                continue
            seen.add(storage)
            key = "inputs" if storage in inputs else self.layer_of(node)
            self.bytes[key] = self.bytes.get(key, 0) + val.untyped_storage().nbytes()

    def layer_of(self, node: torch.fx.Node) -> str:
        if node.op == "placeholder":
            return "inputs"
        for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
            name = module_path(path)
            for i, layer in enumerate(self.layer_names):
                if name == layer or name.startswith(layer + "."):
                    return f"L{i}"
        return "other"

    def activations(self) -> int:
        """Bytes saved beside the graph's inputs: what the step holds for its backward."""
        return sum(b for k, b in self.bytes.items() if k != "inputs")
