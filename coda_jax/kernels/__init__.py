"""Fused accelerator kernels (Pallas), one module per kernel.

Each kernel is an alternative implementation of an XLA reference elsewhere in
`coda_jax`, chosen by config (`'auto'` picks the kernel on GPU only) and tested
against that reference in Pallas interpret mode on CPU:

* `coda_jax.kernels.soft_topk` -- the iterative soft top-k
  (`coda_jax.soft_topk`, `SoftTopKConfig(impl=...)`).

Import the submodules explicitly; this package imports nothing, so that
`import coda_jax` never loads Pallas.
"""
