"""The names every ACM module shares: parameter names and logical axes.

Parameters of an ACM (see the package docstring):

  ``<layer>/acm_mlp/{wi_0,wi_1,wo}``, ``<layer>/acm_mlp/gate/...``  an FFN's learners
  ``<attention>/acm_{query,key,value,out}/{a,b,gate/...}``          a projection's

This module imports nothing from the package.
"""
from __future__ import annotations

import jax

from coda_jax.config import (ACM_ATTENTION_PROJECTIONS, ACM_CHOICES_AXIS, ACM_GATE_AXIS,
                             ACM_GATE_IN_AXIS, ACM_RANK_AXIS)

Array = jax.Array

# Logical axes of the gate's hidden width and of the N + 1 choices, and of the
# rank R of an attention projection's low-rank learners.
GATE_AXIS = ACM_GATE_AXIS
GATE_IN_AXIS = ACM_GATE_IN_AXIS
CHOICES_AXIS = ACM_CHOICES_AXIS
RANK_AXIS = ACM_RANK_AXIS
# The module that replaces a layer's `mlp`, and its gate.
ACM_MLP = 'acm_mlp'
GATE_NAME = 'gate'
# The modules that replace an attention's projections: `acm_query`,
# `acm_key`, `acm_value`, `acm_out` (siblings of `query`, ... inside the
# attention), each with factors `a` [in, R], `b` [R, out] and its own gate.
ACM_PROJECTION_PREFIX = 'acm_'
ACM_PROJECTIONS = tuple(ACM_PROJECTION_PREFIX + p for p in ACM_ATTENTION_PROJECTIONS)
LOW_RANK_LEAVES = ('a', 'b')
