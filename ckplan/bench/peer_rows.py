"""Peer rows (:mod:`ckplan.peers`): hf and sac-policy planned on the every-k k=1 layer split, and
what their predictions leave out."""
from __future__ import annotations

from ..chainfind import resolve_chain
from ..peers import is_hf_model
from ..planner import Plan, Store, chain_from_profile, held_for_backward_bytes, plan_chain, simulate
from ..planner.plan import items_from_ranges
from ..planner.simulate import forward_backward_peak
from ..records import Profile
from .entry import Entry

PEERS_NOTE = ("peers (kind peer): hf = every chain layer in its own non-reentrant checkpoint (ckplan's every-k "
              "k=1, as Hugging Face's gradient_checkpointing_enable does); sac-policy = torch selective "
              "activation checkpointing per chain layer, saving matmul/attention/convolution outputs and "
              "recomputing the rest (no ckplan prediction); offload-all = every tensor the chain layers save "
              "copied to pinned host memory on a side stream and back when the backward needs it, as "
              "torchtune's OffloadActivations does (CUDA; no ckplan prediction); offload-attn = what the attention "
              "blocks of every chain layer but the last save, offloaded the same way, as Megatron's fine-grained "
              "activation offloading of core_attn and attn_proj does (CUDA; no ckplan prediction); "
              "torch-compile = the model compiled with torch.compile (TorchInductor) with torch._functorch.config."
              "activation_memory_budget set from the bench's budget (the share of none's activation memory "
              "it leaves), so the min-cut "
              "partitioner recomputes to meet it; torch-compile-nobudget = the same at budget 1.0 (fusion "
              "and the partitioner's default recomputation only)")


def peer_entry(chain, name: str) -> Entry:
    """A peer runs on the every-k k=1 plan's layer split: ``hf`` is that plan (so its prediction
    is that plan's), ``sac-policy`` checkpoints the same layers selectively: predicted as every
    layer stored with ckplan's ``sac-compute`` option when the profile has it on every layer."""
    plan = plan_chain(chain, "every-k", None, 1).plan
    if name == "hf":
        sc = simulate(chain, plan)
        return Entry(name, plan, sc.peak_bytes, forward_backward_peak(chain, plan),
                     held_for_backward_bytes(chain, plan), sc.overhead, kind="peer",
                     message="ran as every-k k=1: each chain layer in its own non-reentrant checkpoint, "
                             "as Hugging Face's gradient_checkpointing_enable does")
    if name == "offload-all":
        return Entry(name, plan_chain(chain, "none").plan, kind="peer",
                     message="every tensor the chain layers save offloaded to pinned host memory on a side stream, "
                             "copied back when the backward needs it (torchtune-style; no ckplan prediction)")
    if name == "offload-attn":
        return Entry(name, plan_chain(chain, "none").plan, kind="peer",
                     message="what the attention blocks of every chain layer but the last save offloaded to pinned "
                             "host memory, each block's input kept (Megatron-style; no ckplan prediction)")
    message = ("torch selective checkpointing per chain layer: saves mm/addmm/bmm/attention/"
               "convolution outputs, recomputes the rest")
    if all(any(o.name == "sac-compute" for o in ly.options) for ly in chain.layers):
        # The same thing as ckplan's sac-compute option on every layer: predicted by that plan.
        n = chain.n_layers
        sac = Plan("sac-policy", n, tuple(Store(i, "sac-compute") for i in range(n)))
        sc = simulate(chain, sac)
        return Entry(name, sac, sc.peak_bytes, forward_backward_peak(chain, sac),
                      held_for_backward_bytes(chain, sac), sc.overhead, kind="peer",
                      message=message + "; predicted as ckplan's sac-compute option on every layer")
    return Entry(name, plan, kind="peer", message=message)


def _hf_checkpointed_layers(model, chain_path: str) -> tuple[int, tuple[int, ...]]:
    """(layers Hugging Face's own checkpointing wraps, the chain indices among them)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return 0, ()
    _, container, _ = resolve_chain(model, chain_path)
    chain = {id(m): i for i, m in enumerate(container.children())}
    own: list = []

    def outermost(m) -> None:  # a checkpointed layer's own checkpointed blocks run inside it
        for child in m.children():
            if isinstance(child, GradientCheckpointingLayer):
                own.append(child)
            else:
                outermost(child)

    outermost(model)
    return len(own), tuple(sorted(chain[id(m)] for m in own if id(m) in chain))


def _hf_nested(model, chain_path: str) -> dict[int, str]:
    """Chain layers holding Hugging Face checkpointed blocks of their own (Zamba2's hybrid layers
    run their Mamba layer in a checkpoint inside theirs): index -> the inner blocks' class."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return {}
    _, container, _ = resolve_chain(model, chain_path)
    nested = {}
    for i, layer in enumerate(container.children()):
        inner = {type(m).__name__ for m in layer.modules()
                 if m is not layer and isinstance(m, GradientCheckpointingLayer)}
        if inner and isinstance(layer, GradientCheckpointingLayer):
            nested[i] = ", ".join(sorted(inner))
    return nested


def _predict(e: Entry, chain, wrapped: tuple[int, ...]) -> None:
    """``e``'s plan and predictions: the ``wrapped`` chain layers each in a checkpoint."""
    e.plan = Plan("hf", chain.n_layers, items_from_ranges(chain.n_layers, [(i, i + 1) for i in wrapped]))
    sc = simulate(chain, e.plan)
    e.predicted_peak, e.predicted_fb_peak = sc.peak_bytes, forward_backward_peak(chain, e.plan)
    e.predicted_act, e.predicted_overhead = held_for_backward_bytes(chain, e.plan), sc.overhead


def peer_predictions(entries: list[Entry], model, profile: Profile, notes: list[str]) -> None:
    """What the peers' predictions leave out: an hf model's own checkpointing beyond the chain, and
    any prediction at all when the profile is of compiled layers (peers run eagerly)."""
    for e in entries:
        if e.kind == "peer" and e.name == "hf" and is_hf_model(model):
            e.message = ("the model's own activation_checkpointing_enable(use_reentrant=False); predicted: "
                         "every-k k=1")
            own, wrapped = _hf_checkpointed_layers(model, profile.chain)
            in_chain, n = len(wrapped), len(profile.chain_layers)
            if own == in_chain and 0 < in_chain < n:
                # Some chain layers are not GradientCheckpointingLayers (MobileViT-v2's MobileNet
                # blocks): Hugging Face checkpoints the others only, and so does the prediction.
                _predict(e, chain_from_profile(profile), wrapped)
                e.message = ("the model's own activation_checkpointing_enable(use_reentrant=False); predicted: "
                             f"chain layers {', '.join(map(str, wrapped))} each in a checkpoint, the other "
                             f"{n - in_chain} stored, as Hugging Face does")
            nested = _hf_nested(model, profile.chain) if e.predicted_peak is not None else {}
            if nested:
                # The inner checkpoint's call keeps its arguments (made inside the outer layer)
                # until its backward, and the recompute runs it in a checkpoint again.
                e.message += (f"; chain layers {', '.join(map(str, nested))} also run their "
                              f"{', '.join(sorted(set(nested.values())))} in a checkpoint of its own, whose "
                              "arguments stay alive until its backward: not in the prediction")
            if own > in_chain:
                # An encoder-decoder checkpoints its decoder too: the chain plan does not describe it.
                e.predicted_peak = e.predicted_fb_peak = e.predicted_act = e.predicted_overhead = None
                e.message = (f"the model's own activation_checkpointing_enable(use_reentrant=False): it "
                             f"checkpoints {own} layers, {own - in_chain} outside the chain, so no prediction")
        if e.kind == "peer" and profile.compiled and e.compiled is None:
            # Peers run as they are (eagerly), while the profile, and so every prediction, is of
            # the compiled layers: no prediction for them.
            e.predicted_peak = e.predicted_fb_peak = e.predicted_act = e.predicted_overhead = None
            kept = [part for part in e.message.split("; ") if part and not part.startswith("predicted")]
            e.message = "; ".join([*kept, "ran eagerly, so no prediction (the profile is of compiled layers)"])
    if any(e.kind == "peer" for e in entries):
        notes.append(PEERS_NOTE)
