"""Fused accelerator kernels (Pallas, and cuDNN's attention), one module per kernel.

Each kernel is an alternative implementation of an XLA reference elsewhere in
`coda_jax`, chosen by config (`'auto'` picks it on the backend it is for) and
tested against that reference in Pallas interpret mode on CPU:

* `coda_jax.kernels.soft_topk` -- the iterative soft top-k on GPU
  (`coda_jax.model.soft_topk`, `SoftTopKConfig(impl=...)`).
* `coda_jax.kernels.relpos_attention` -- TPU attention with T5's relative
  position bias computed in the kernel (`T5Config.attention_kernel`).
* `coda_jax.kernels.unroute_combine` -- a routed layer's output, x + adapter
  up projection + un-route, on TPU (`CodaConfig.unroute_kernel`).
* `coda_jax.kernels.mlp` -- an encoder layer's pre-MLP norm and (gated) MLP
  on TPU, its hidden units kept in VMEM (`T5Config.mlp_kernel`).
* `coda_jax.kernels.route_adapter` -- a routed layer's route and its parallel
  adapter's down projection from one read of its input, on TPU
  (`CodaConfig.route_kernel`).
* `coda_jax.kernels.decode_attention` -- a decoding step's cross-attention
  over the cached encoder keys/values on TPU, its logits kept in VMEM
  (`T5Config.decode_attention_kernel`).
* `coda_jax.kernels.slot_attention` -- beam search's self-attention over a
  cache addressed by slot on TPU, each beam's ancestors' keys/values gathered
  in VMEM, the cache never reordered (`T5Config.beam_attention_kernel`).
* `coda_jax.kernels.top_logits` -- beam search's LM head on TPU: each row's
  top logits and log-softmax normaliser, the logits kept in VMEM
  (`T5Config.lm_head_kernel`).
* `coda_jax.kernels.fused_attention` -- the encoder's attention on a GPU
  through cuDNN's fused flash attention (`jax.nn.dot_product_attention`),
  the padding as sequence lengths (`T5Config.fused_attention`); off a GPU
  the same call's XLA implementation.

`coda_jax.kernels.tpu_blocks` holds what the TPU kernels share: their VMEM
budget, each chip's VMEM, row blocks and mesh axes.

Import the submodules explicitly; this package imports nothing, and the TPU
kernels import Pallas only when they build a call, so that `import coda_jax`
never loads Pallas.
"""
