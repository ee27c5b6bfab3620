"""The parts of a profile, which :mod:`ckplan.profiler` runs as one pipeline.

* ``instrument``: hooks that cut a step into per-stage windows (``side_inputs``, ``meters`` and
  ``readouts`` are what they note, where bytes come from, and what the notes say per stage);
* ``step``: one profiled step, and the guards around a profile (errors, state, hooks);
* ``passes``: the measured, no-save and recompute-kept passes (sizes);
* ``timing``: the timed passes and the per-layer times made from them;
* ``option_passes`` / ``compiled_passes``: selective options on eager layers; compiled layers;
  ``option_sample``: options on meta measured on three layers when the middle ones are one layer;
* ``rows``: the passes as StageRecord rows; ``notes``: what the profile says it assumed;
* ``flops``: FLOP counting, never fatal.

Import the parts from their modules (``from ckplan.profiling.notes import BREAKS_NOTE``): the
package itself imports nothing, so no part imports another through it.
"""
