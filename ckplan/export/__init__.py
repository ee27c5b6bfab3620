"""Turn a ckplan Plan into the snippet or config that applies it in a training framework.

``export_plan(plan, target, chain_path=...)`` returns an :class:`Export`: the text to paste, whether
it reproduces the plan exactly, the plan it actually applies (``closest_plan``) and an honest
message. Pure Python (no torch import): the snippets are text, run by the user.

What each target can express (checked in the sources named)
-------------------------------------------------------------

None of the four can express a checkpoint that spans several layers or nests inside another: each
wraps *one module* (a chain layer) in ``torch.utils.checkpoint``. So a plan is expressible only when
every top-level item is ``Store(i)`` or ``Checkpoint(i, i + 1)`` (a *per-layer* plan), and each
target then allows these sets of checkpointed layers:

* ``fsdp`` -- PyTorch's ``apply_activation_checkpointing(model, checkpoint_wrapper_fn=
  checkpoint_wrapper, check_fn=...)`` (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py,
  torch 2.13) wraps every submodule for which ``check_fn`` is true; ``checkpoint_wrapper`` defaults
  to non-reentrant checkpointing. Any set of layers. It works on a plain module, before any
  wrapping (``fully_shard`` / ``torch.compile``), the order torchtitan uses; tests/test_export.py
  runs it under FSDP2's ``fully_shard`` (one gloo rank on CPU). DDP and FSDP1 are not run here.
* ``lightning`` -- Lightning's ``FSDPStrategy(activation_checkpointing_policy={Block})`` becomes
  ``apply_activation_checkpointing(..., auto_wrap_policy=ModuleWrapPolicy({Block}))``: every
  instance of the class (lightning/fabric/strategies/fsdp.py, ``_activation_checkpointing_kwargs``
  and ``_setup_activation_checkpointing``, Lightning-AI/pytorch-lightning 7f0c343). Any set of
  layers is expressible from the ``LightningModule.configure_model`` hook (any strategy) with the
  same ``apply_activation_checkpointing`` call as ``fsdp``; the export uses that, and names the
  class policy too when the plan checkpoints every layer.
* ``hf`` -- transformers 5.23: ``model.activation_checkpointing_enable(activation_checkpointing_kwargs,
  every_n_layers=N)`` (``gradient_checkpointing_enable`` is its deprecated alias) sets
  ``gradient_checkpointing = (index % N == 0)`` on every ``GradientCheckpointingLayer`` in
  ``model.modules()`` order, i.e. layers 0, N, 2N, ... (modeling_utils.py
  ``_set_gradient_checkpointing``); ``TrainingArguments(activation_checkpointing=True,
  activation_checkpointing_kwargs={"every_n_layers": N})`` does the same from ``Trainer.train()``.
  Each ``GradientCheckpointingLayer`` reads its own flag at call time (modeling_layers.py,
  ``forward_with_checkpointing``), so setting ``layer.gradient_checkpointing`` after enabling gives
  any set of layers. The every-N one-liner is exact only when the chain layers are the model's only
  ``GradientCheckpointingLayer``s (no vision tower or encoder before them); the per-layer form
  always is. Models whose layers do not subclass ``GradientCheckpointingLayer`` (some older
  architectures still checkpoint from the model's loop) only have every layer or none; the
  snippet checks and points to ``--export fsdp`` then. transformers 4.5x has the same per-layer
  flag under ``gradient_checkpointing_enable(gradient_checkpointing_kwargs)`` and no
  ``every_n_layers``: the per-layer form calls whichever name the model has.
* ``torchtitan`` -- torchtitan <= 0.2.2 (TOML job config): ``[activation_checkpoint] mode =
  "none" | "full" | "selective"`` with ``selective_ac_option = "N"`` wrapping the blocks of
  ``model.layers`` whose 1-based count is a multiple of N, i.e. layers N-1, 2N-1, ... (0-based;
  torchtitan/distributed/activation_checkpoint.py ``_apply_layer_sac``, tag v0.2.2; the counter
  is global, so several model chunks on one rank continue each other's count). Torchtitan 0.3
  removed the layer-frequency option (pytorch/torchtitan#2357, March 2026): there only no
  checkpointing, ``FullAC`` (every layer) or op-level ``SelectiveAC`` remain, and op-level
  selective recomputation is not a ckplan plan.

Closest expressible plan (when ``exact`` is False)
--------------------------------------------------

* ``fsdp``, ``lightning``, ``hf``: every layer the plan recomputes (inside any checkpoint) is
  checkpointed alone, the others stored. Same recomputed layers, each recomputed once (a nested
  plan recomputes some several times), but a multi-layer segment ``[s, t)`` keeps only its input
  and last output while per-layer checkpoints keep the inputs of layers ``s+1..t-1`` as well (more
  held for backward; the peak can still be lower, each recompute being one layer: the CLI prints
  both predicted peaks).
* ``torchtitan``: with ``c`` layers recomputed by the plan, the every-N pattern with the fewest
  checkpointed layers that is still at least ``c`` (the largest N with ``n // N >= c``; N = 1 is
  ``mode = "full"``, c = 0 is ``mode = "none"``). For similar layers that does not raise the peak
  beyond what c single-layer checkpoints give; which layers differ is stated in the message.

Selective options (``Store(i, "sac-...")``) are not expressed by any target: the export applies the
same checkpoints with those layers stored whole, says so, and is not exact.

Every message also names the exact fallback: ``ckplan.apply_plan(model, "plan.json")`` runs any
plan, nested checkpoints included, inside the user's own training loop.

The package: :mod:`~ckplan.export.base` (targets, :class:`Export`), :mod:`~ckplan.export.layers`
(a plan in the targets' terms), :mod:`~ckplan.export.targets` (one mapping per target) and
:mod:`~ckplan.export.dispatch` (:func:`export_plan`).
"""
from .base import FALLBACK, TARGETS, Export
from .dispatch import export_plan
from .layers import hf_every_n, per_layer_plan, per_layer_set, recomputed_layers, torchtitan_every_n

__all__ = ["FALLBACK", "TARGETS", "Export", "export_plan", "hf_every_n", "per_layer_plan", "per_layer_set",
           "recomputed_layers", "torchtitan_every_n"]
