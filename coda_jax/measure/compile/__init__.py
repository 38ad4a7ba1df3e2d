"""Ahead-of-time compilation for TPU pods, on any machine (``coda-jax compile``).

* `chips`: chip facts (HBM, peak FLOP/s, HBM / ICI bandwidth, with sources)
  and pods by the names users type;
* `topology`: a pod's compile-only devices from libtpu (the only module of
  coda_jax that loads it);
* `analysis`: compile a lowered program, read its memory, cost, roofline
  and collectives;
* `hlo_costs`: collectives and bytes by named stage from compiled HLO text;
* `programs`: the train steps and decoding programs of a gin-configured run;
* `command`: the ``coda-jax compile`` command line.
"""
