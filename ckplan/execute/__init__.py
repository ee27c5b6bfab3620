"""Apply any Plan (nested checkpoints included) to a model's chain with torch's checkpointing.

How: each chain layer's ``forward`` is replaced by an instance attribute (a small picklable
object; state_dict keys, hooks and the module tree stay as they are; ``remove()`` restores the
originals). The model's own forward still calls every layer itself, with its own arguments.

* ``Store(i)`` layers run as before; with a selective option (``Store(i, "sac-compute")``) the
  layer runs inside one checkpoint with that option's SAC policy (:mod:`ckplan.sac`), in the
  first forward when it is stored at the top level, in its checkpoint's recompute otherwise.
* A top-level ``Checkpoint(s, t)`` spans the model's calls of layers s..t-1 with one
  non-reentrant checkpoint frame (torch.utils.checkpoint's ``_CheckpointFrame`` and
  ``_checkpoint_hook``). Its saved-tensor hook is active only *inside* those layer calls, so the
  tensors the layers save are dropped and the model's own code between two calls saves as usual.
  Each call is recorded: its arguments and keywords with the hidden-state tensors left out (so
  the record keeps no intermediate activation alive; masks, position embeddings and per-layer
  arguments are kept), the RNG state and the autocast state. During backward the frame's
  recompute replays the recorded calls from the segment's saved input, each layer with its own
  arguments, RNG and autocast state, following the checkpoint's ``inner`` plan: nested
  checkpoints are nested frames in the first forward and nested
  ``torch.utils.checkpoint.checkpoint`` calls in the recompute, so a saved tensor of an inner
  checkpoint belongs to the innermost frame and an inner checkpoint's input is saved to its
  parent (torch's rules for nested checkpoints). Memory is what the planner models: a checkpoint
  keeps its input and its last output, nothing per layer.
* The hidden state of layer j+1 is found by identity: the tensor in its arguments (positional
  or keyword, inside tuples, lists and dicts too, as ``torch.utils._pytree`` flattens them) that
  *is* a tensor layer j returned. Several such tensors (a hidden state and a residual stream, a
  dict of them) are all carried; the recorded call is rebuilt around them in the recompute. For
  the first layer of a segment it is the first positional tensor, else ``hidden_states=``, else
  the first tensor in the arguments.

Known limits:

* A model that changes the hidden state between two layers of one segment (``x = layer(x) *
  0.5``, ``h = h + layer(h)``, a skip connection added, or in place) is refused with
  ModelRunError: spanning it would keep every changed tensor. Checkpoints of one layer each
  always work, and ckplan's own plans never span such a boundary: the profile finds them
  (``Profile.chain_breaks``) and every strategy cuts its checkpoints there.
* A Hugging Face key/value cache passed to a checkpointed layer is refused (ModelRunError):
  the recompute would append to it twice. Training wants ``use_cache: false``.
* A checkpoint keeps the tensors its layers receive besides the hidden state (masks, position
  ids) until its backward, as ``torch.utils.checkpoint`` keeps its arguments. When no op of the
  plain step saves them they add their bytes to the plan's peak, which the profile does not
  model (4.5 KiB, a bool sliding-window mask and ``position_ids``, on configs/hf-qwen2-alt.yaml).
* A layer called with an intermediate activation that is not the previous layer's output (a
  skip connection over several layers) runs correctly, but the record keeps that tensor alive
  until backward, which the planner does not model.
* A layer built to change its input in place (``inplace=True``: torchvision's ``ReLU``) gets a
  copy of its hidden-state input when a checkpoint starts at it (its first forward and the start
  of its recompute): changing the tensor a checkpoint saved would make PyTorch refuse the
  backward. Elsewhere it runs in place, as measured (``Layer.in_place`` in the planner). So does a
  layer the plan names in ``params["copy_inputs"]`` (its forward changes an argument in place:
  ``Layer.copies_input``); a checkpoint starting at any other layer whose forward changes its
  arguments stops there with PlanRunError, before a wrong recompute.
* A container the layers write into (a ``UserDict`` or list pytree keeps whole: Gemma 4's
  ``shared_kv_states``) is recorded as a shallow copy of what the call found, and each recompute
  writes into a fresh copy of that: the model's own container and a recompute's tensors are not
  kept alive by the record.
* Each recorded call holds a copy of the CPU RNG state (5 KB of host memory, plus the device
  RNG states when a GPU is in use) until the segment's backward.
* A recompute leaves every buffer the layer's forward changes (BatchNorm's and InstanceNorm's
  running statistics, ``F.batch_norm`` on the layer's own buffers, a moving average or counter)
  as the first forward left them (:mod:`ckplan.recompute`); those buffers, a few KiB as a rule,
  are copied during the layer's recompute. The recompute sees them updated once, so a layer whose
  output depends on a buffer it updates computes something else there (bench: wrong-gradients).
* The recompute calls each layer's original ``forward`` directly: forward (pre-)hooks registered
  on the chain layers themselves run in the first forward only (hooks on their submodules run in
  both, as with torch's checkpoint).
* The frame machinery is a private part of torch (two versions of it, torch 2.5 to 2.14, are
  known). Where it is missing or fails a probe (``spans_layers``), profiles mark every layer a
  chain break, so plans made there use one-layer checkpoints and predict their peaks; a plan with
  multi-layer checkpoints made elsewhere runs each layer of a segment as its own checkpoint, with
  a warning: the math is the same, the memory is that of one-layer checkpoints.
* ``copy.deepcopy`` and pickling (``torch.save(model)``) keep the plan: the copy carries its
  own executor bound to the copy's layers (loading it needs ckplan importable). Call
  ``remove_plan(model)`` first for a plain copy. ``state_dict`` is unchanged by a plan.

frames    torch's private checkpoint frames, both ways of saving a frame's inputs
calls     a segment's records in the first forward: layer calls, open frames, hidden-state links
probe     whether this torch's frames span several layers (spans_layers)
executor  PlanExecutor: the installed plan, its first forward and its recompute
apply     apply_plan(), remove_plan(), load_plan()
offload   saved activations to pinned host memory on a side stream (CUDA; the offload-all peer)
"""
from .apply import apply_plan, load_plan, remove_plan
from .calls import in_place_layer
from .executor import PlanExecutor, _PlannedForward, spans_layers

# Pickled models with a plan name these classes by this path (and load with it).
PlanExecutor.__module__ = _PlannedForward.__module__ = __name__

__all__ = ["PlanExecutor", "apply_plan", "in_place_layer", "load_plan", "remove_plan", "spans_layers"]
