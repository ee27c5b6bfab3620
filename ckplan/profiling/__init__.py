"""The parts of a profile, which :mod:`ckplan.profiler` runs as one pipeline.

* ``flops``: FLOP counting, never fatal.
"""
