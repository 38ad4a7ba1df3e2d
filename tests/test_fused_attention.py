"""cuDNN's fused attention for the encoder on a GPU (`T5Config.fused_attention`).

On a GPU the plan may run the encoder's attention (dense and routed layers)
through `jax.nn.dot_product_attention(implementation='cudnn')`, the relative
position bias as its bias and the padding as each row's real keys. Here, on
the CPU, the same call runs jax's XLA implementation (interpret mode): the
model must equal XLA's attention on every real token, forward and backward;
the call must ask cuDNN for sequence lengths, never a dense mask; the plan
must give it only the calls cuDNN takes, and say why not otherwise.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import plan as plan_lib
from coda_jax.config import CodaConfig, T5Config
from coda_jax.kernels import fused_attention
from coda_jax.model.attention import MultiHeadDotProductAttention
from coda_jax.model.network import Transformer
from coda_jax.plan.attention import AttentionPlan
from coda_jax.plan.target import Target

from tiny_models import tiny_config

GPU = Target('gpu', 'NVIDIA H100 80GB HBM3')
CPU = Target('cpu', 'cpu')
N = 12


def _inputs():
  rng = np.random.RandomState(0)
  enc = rng.randint(2, 64, (3, N)).astype(np.int32)
  enc[1, 7:] = 0          # padding at the end of a row, as seqio pads
  enc[2, 4:] = 0          # fewer real tokens than a routed layer's k
  dec = rng.randint(2, 64, (3, 5)).astype(np.int32)
  return jnp.asarray(enc), jnp.asarray(dec)


@pytest.mark.parametrize('attention', [None, 'k_to_all', 'k_to_k'])
def test_the_encoder_through_cudnn_s_call_is_xla_s(attention):
  """Dense layers, and routed ones at r = 3 (k = 4 of 12: the third row's
  real tokens fill its routed keys, the second's do not), with every
  parameter's gradient: equal to XLA's attention on the real tokens."""
  coda = None if attention is None else CodaConfig(reduction_factor=3, attention=attention)
  enc, dec = _inputs()
  real = (enc > 0)[..., None]
  projection = jnp.asarray(np.random.RandomState(1).randn(tiny_config().emb_dim), jnp.float32)
  results = {}
  for setting in ('xla', 'cudnn'):
    model = Transformer(dataclasses.replace(tiny_config(), fused_attention=setting), coda=coda)

    def loss(params, model=model):
      out = model.apply({'params': params}, enc, method=model.encode, enable_dropout=False)
      return jnp.sum(jnp.where(real, out, 0.) * projection), out

    @jax.jit
    def run(rng, model=model, loss=loss):
      params = model.init(rng, enc, dec, dec, enable_dropout=False)['params']
      (_, out), grads = jax.value_and_grad(loss, has_aux=True)(params)
      return out, grads

    with plan_lib.recording() as plans:
      results[setting] = run(jax.random.PRNGKey(0))
    encoder_plans = [p for p in plans if isinstance(p, plan_lib.Plan)]
    assert encoder_plans
    for plan in encoder_plans:
      layers = [p for p in (plan.dense, plan.routed) if p is not None]
      assert {p.attention_plan.formulation for p in layers} == (
          {'cudnn'} if setting == 'cudnn' else {'batch_major'})
  (xla_out, xla_grads), (out, grads) = results['xla'], results['cudnn']
  np.testing.assert_allclose(np.where(real, out, 0.), np.where(real, xla_out, 0.), atol=1e-5,
                             rtol=1e-5)
  flat, xla_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(xla_grads)
  for (path, g), want in zip(flat, xla_flat):
    np.testing.assert_allclose(g, want, atol=1e-5, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))
  assert max(float(jnp.max(jnp.abs(g))) for g in xla_flat) > 0


def test_cudnn_is_asked_for_with_lengths_not_a_mask(monkeypatch):
  """On a GPU the call names cuDNN and gives each row's real keys; no dense
  mask reaches it (cuDNN with an explicit mask reads a [b, heads, q, kv]
  array and runs far below its peak)."""
  calls = []

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return jnp.zeros(args[0].shape, args[0].dtype)

  monkeypatch.setattr(jax.nn, 'dot_product_attention', spy)
  layer = MultiHeadDotProductAttention(num_heads=4, head_dim=8, dtype=jnp.bfloat16,
                                       plan=AttentionPlan('cudnn', interpret=False))
  x = jnp.ones((2, 6, 16), jnp.bfloat16)
  real = jnp.asarray([[True] * 6, [True] * 4 + [False] * 2])
  mask = (real[:, None, :, None] & real[:, None, None, :]).astype(jnp.float32)
  params = layer.init(jax.random.PRNGKey(0), x, x, mask, deterministic=True,
                      query_token_mask=real, kv_token_mask=real, mask_is_padding=True)
  layer.apply(params, x, x, mask, deterministic=True, query_token_mask=real,
              kv_token_mask=real, mask_is_padding=True)
  call = calls[-1]
  assert call['implementation'] == 'cudnn' and call['scale'] == 1.0
  assert 'mask' not in call
  np.testing.assert_array_equal(call['key_value_seq_lengths'], [6, 4])
  assert call['key_value_seq_lengths'].dtype == jnp.int32
  calls.clear()
  fused_attention.fused_attention(x.reshape(2, 6, 2, 8), x.reshape(2, 6, 2, 8),
                                  x.reshape(2, 6, 2, 8), interpret=True)
  assert calls[-1]['implementation'] is None        # jax's XLA implementation


def _plan(target, training=False, packed=False, **fields):
  """The plan of the tiny model's encoder, its first layer dense, the
  second routed at r = 3."""
  config = dataclasses.replace(tiny_config(), **fields)
  coda = CodaConfig(reduction_factor=3, routed_layers=(1,))
  return plan_lib.resolve(config, coda, target=target, length=N, training=training,
                          packed=packed)


def test_the_plan_gives_cudnn_only_calls_it_takes_and_says_why():
  # Asked for, on a GPU, in bfloat16: both layer kinds, natively.
  plan = _plan(GPU, fused_attention='cudnn', dtype=jnp.bfloat16)
  for layer in (plan.dense, plan.routed):
    assert layer.fused_attention == 'cudnn'
    assert layer.attention_plan == AttentionPlan('cudnn', interpret=False)
  assert plan.kernels() == ('fused_attention',)
  reasons = dict(plan.reasons)
  assert reasons['routed fused_attention'] == "cudnn: T5Config.fused_attention = 'cudnn'"
  assert 'routed attention cudnn' in plan.summary()
  # 'auto' on a GPU: no measured row yet, XLA's fusions, said so.
  plan = _plan(GPU, dtype=jnp.bfloat16)
  assert plan.routed.fused_attention == 'xla' and plan.kernels() == ()
  assert dict(plan.reasons)['routed fused_attention'] == 'xla: auto: no rule for gpu (default)'
  # What cuDNN does not take, on a GPU.
  cases = [(dict(dtype=jnp.float32), [], 'float32 activations (cuDNN takes bfloat16 or float16)'),
           (dict(dtype=jnp.bfloat16, dropout_rate=0.1), ['training'], 'attention dropout'),
           (dict(dtype=jnp.bfloat16), ['packed'], 'packed inputs (segment masks)'),
           (dict(dtype=jnp.bfloat16, head_dim=160), [],
            'head_dim 160 (cuDNN takes a multiple of 8 up to 128)')]
  for fields, flags, why in cases:
    plan = _plan(GPU, training='training' in flags, packed='packed' in flags,
                 fused_attention='cudnn', **fields)
    assert plan.routed.fused_attention == 'xla', fields
    assert plan.routed.attention_plan.formulation != 'cudnn'
    assert dict(plan.reasons)['routed fused_attention'].startswith(f'xla: {why}'), fields
  # Off a GPU the call is jax's XLA implementation: any dtype; 'auto' asks
  # nothing there (no reason line), and a TPU's attention kernel wins.
  plan = _plan(CPU, fused_attention='cudnn')
  assert plan.routed.attention_plan == AttentionPlan('cudnn', interpret=True)
  assert 'routed fused_attention' not in dict(_plan(CPU).reasons)
  tpu = _plan(Target('tpu', 'TPU v5 lite'), fused_attention='cudnn', attention_kernel='pallas')
  assert tpu.routed.attention_plan.formulation == 'relpos_kernel'
  assert tpu.routed.fused_attention == 'xla'


def test_a_layer_given_cudnn_for_a_call_it_cannot_take_says_why():
  layer = MultiHeadDotProductAttention(num_heads=4, head_dim=8, dropout_rate=0.1,
                                       plan=AttentionPlan('cudnn', interpret=False))
  x = jnp.ones((2, 6, 16), jnp.float32)
  with pytest.raises(ValueError) as error:
    layer.init({'params': jax.random.PRNGKey(0), 'dropout': jax.random.PRNGKey(1)}, x, x,
               deterministic=False)
  assert str(error.value) == (
      "the fused_attention kernel (T5Config.fused_attention='cudnn') cannot compute this "
      'call: attention dropout, float32 activations (cuDNN takes bfloat16 or float16); '
      "use 'xla'")
  with pytest.raises(ValueError, match=r"T5Config.fused_attention must be one of \('auto', "
                                       r"'xla', 'cudnn'\), got 'flash'"):
    T5Config(fused_attention='flash')
