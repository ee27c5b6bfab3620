"""What the smallest feasible peak is made of, and the fixes that can move it.

``infeasible_error`` builds the message of :class:`ckplan.errors.InfeasibleBudgetError`: it
names the floor's parts (parameters, gradients, optimizer state, the optimizer step's transient,
the smallest activation footprint) from the chain's breakdown fields, and offers only the fixes
that can lower that floor: sharding or offloading the optimizer state, a smaller optimizer (not
when SGD is already used), sharding the parameters when they alone exceed the budget, a smaller
batch only when activations are a real part of the floor, and always a bigger budget.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InfeasibleBudgetError
from ..units import format_bytes as fb
from .chain import Chain

# Activations are "a real part" of the floor when they are at least this share of it.
ACTIVATION_SHARE = 0.10
# What is saved outside the chain (before it, and in the head after it) is worth naming when it
# is at least this share of the activation floor: no plan can lower it.
OUTSIDE_SHARE = 0.5


@dataclass(frozen=True)
class Floor:
    """The smallest feasible peak, split into what sets it (bytes; 0 when unknown)."""

    peak_bytes: int
    at_optimizer_step: bool  # True when the optimizer step sets the floor, not forward/backward
    param_bytes: int
    grad_bytes: int  # gradients live at the floor (all of them at the optimizer step)
    optimizer_bytes: int
    step_tmp_bytes: int  # the optimizer step's transient (0 when the floor is not the step)
    activation_bytes: int  # the least any plan holds above the fixed memory (0 at the step)
    other_bytes: int  # batch, buffers and whatever the breakdown does not name

    def parts(self) -> list[tuple[str, int]]:
        named = [("parameters", self.param_bytes), ("gradients", self.grad_bytes),
                 ("optimizer state", self.optimizer_bytes),
                 ("optimizer-step transient", self.step_tmp_bytes),
                 ("activations and gradients (the least any plan holds)", self.activation_bytes),
                 ("batch, buffers and other", self.other_bytes)]
        return [(k, v) for k, v in named if v > 0]


def floor_of(chain: Chain, lowest: int) -> Floor:
    """Split ``lowest`` (the smallest feasible peak) into its parts."""
    p = chain.persistent_bytes
    params, opt, grads = chain.param_bytes, chain.optimizer_bytes, chain.total_grad_bytes
    fixed_grads = grads if chain.grads_in_persistent else 0
    if chain.opt_step_peak_bytes >= lowest:
        # The optimizer step: parameters, every gradient and the optimizer state are live.
        tmp = max(0, chain.opt_step_peak_bytes - p - (grads - fixed_grads))
        other = max(0, lowest - params - opt - grads - tmp)
        return Floor(lowest, True, params, grads, opt, tmp, 0, other)
    other = max(0, p - params - opt - fixed_grads)
    return Floor(lowest, False, params, fixed_grads, opt, 0, max(0, lowest - p), other)


def _join(parts: list[str]) -> str:
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def infeasible_error(chain: Chain, budget_bytes: int, lowest: int) -> InfeasibleBudgetError:
    """The error for a budget below ``lowest``, with the floor's parts and the fixes that fit."""
    f = floor_of(chain, lowest)
    where = "the optimizer step" if f.at_optimizer_step else "forward/backward, recomputing everything"
    parts = f.parts()
    made_of = f": {_join([f'{k} {fb(v)}' for k, v in parts])}" if parts else ""
    fixes: list[str] = []
    if chain.param_bytes > budget_bytes:
        fixes.append(f"the parameters alone ({fb(chain.param_bytes)}) exceed the budget: shard them "
                     "across devices (FSDP) or offload them")
    if chain.optimizer_bytes:
        fixes.append("shard the optimizer state (ZeRO / FSDP) or offload it to CPU")
        if chain.optimizer != "sgd":
            fixes.append("a smaller optimizer (SGD keeps no state: train.optimizer sgd, --optimizer sgd)")
    if f.activation_bytes >= ACTIVATION_SHARE * lowest:
        made = chain.total_grad_bytes - (chain.total_grad_bytes if chain.grads_in_persistent else 0)
        grads = (f", of which up to {fb(min(made, f.activation_bytes))} are the gradients made so far, which "
                 "do not shrink with the batch" if made else "")
        fixes.append("a smaller batch size or sequence length (input.batch_size, input.shape; "
                     "--batch-size, --seq-len: the least any plan holds is "
                     f"{fb(f.activation_bytes)} of the floor{grads})")
    outside = chain.pre.retained_bytes + chain.post.xbar_bytes
    if f.activation_bytes and outside >= OUTSIDE_SHARE * f.activation_bytes:
        fixes.append(f"a chain that covers more of the model: {fb(outside)} of the activations are "
                     "saved before or after the chain layers, where no plan checkpoints (the embeddings, the "
                     "head and loss, or a second stack: an encoder-decoder's chain is one of its two; "
                     "`ckplan profile` shows them as (pre) and (post), and `chain:` in the spec picks the chain)")
    close = fb(budget_bytes) == fb(lowest)  # the rounded figures alone would read as equal
    need, have = (f"{lowest:,} bytes", f"{budget_bytes:,} bytes") if close else (fb(lowest), fb(budget_bytes))
    fixes.append(f"a budget of at least {need}")
    return InfeasibleBudgetError(
        f"budget {have} is below the smallest feasible peak {need}, reached in "
        f"{where}{made_of}",
        tip=_join(fixes),
        budget_bytes=budget_bytes, min_peak_bytes=lowest, persistent_bytes=chain.persistent_bytes)
