"""Tests for coda_jax.plan.flops: hand-computed MACs and the shape of the speed-up bound."""
import math

import pytest

from coda_jax.plan import flops
from coda_jax.config import T5Config, t5_1_1

# d=4, H=2, G=1 (multi-query), dh=3, m=5, gated MLP (2 input projections).
TINY = T5Config(vocab_size=10, emb_dim=4, num_heads=2, num_kv_heads=1, head_dim=3,
                mlp_dim=5, num_encoder_layers=2, num_decoder_layers=1)


def test_coda_k():
  assert flops.coda_k(384, 3) == 128
  assert flops.coda_k(385, 3) == 129
  assert flops.coda_k(10, 1) == 10
  assert flops.coda_k(10, 2.5) == 4
  assert flops.coda_k(1, 5) == 1
  assert flops.coda_k(0, 2) == 0
  for n, r in [(10, 3), (512, 5), (1024, 3), (7, 7), (100, 1.7)]:
    assert flops.coda_k(n, r) == math.ceil(n / r)
  for bad_r in (0.5, 0, -2, float('inf'), float('nan'), '3', True):
    with pytest.raises(ValueError, match='reduction_factor'):
      flops.coda_k(10, bad_r)
  for bad_n in (-1, 3.5, '8'):
    with pytest.raises(ValueError, match='sequence length n'):
      flops.coda_k(bad_n, 2)


def test_encoder_layer_by_hand():
  # n = 6, a = 2; r = 4 -> k = 2.
  dense = flops.encoder_layer_macs(TINY, 6, variant='dense', adapter_dim=2)
  assert dense == {'q_proj': 144, 'k_proj': 72, 'v_proj': 72, 'logits': 216,
                   'attn_v': 216, 'out_proj': 144, 'mlp': 360, 'adapter': 0,
                   'router': 0, 'total': 1224}
  pa = flops.encoder_layer_macs(TINY, 6, variant='parallel_adapter', adapter_dim=2)
  assert pa['adapter'] == 96 and pa['total'] == 1320
  k_to_all = flops.encoder_layer_macs(TINY, 6, variant='coda_k_to_all',
                                      reduction_factor=4, adapter_dim=2)
  assert k_to_all == {'q_proj': 48, 'k_proj': 72, 'v_proj': 72, 'logits': 72,
                      'attn_v': 72, 'out_proj': 48, 'mlp': 120, 'adapter': 96,
                      'router': 24, 'total': 624}
  k_to_k = flops.encoder_layer_macs(TINY, 6, variant='coda_k_to_k',
                                    reduction_factor=4, adapter_dim=2)
  assert k_to_k == {'q_proj': 48, 'k_proj': 24, 'v_proj': 24, 'logits': 24,
                    'attn_v': 24, 'out_proj': 48, 'mlp': 120, 'adapter': 96,
                    'router': 24, 'total': 432}
  assert flops.encoder_macs(TINY, 6, variant='coda_k_to_k', reduction_factor=4,
                            adapter_dim=2) == 864
  assert flops.encoder_speedup_bound(TINY, 6, 4, 'k_to_all', 2) == pytest.approx(1320 / 624)
  assert flops.encoder_speedup_bound(TINY, 6, 4, 'k_to_k', 2) == pytest.approx(1320 / 432)


def test_ungated_mlp():
  cfg = T5Config(emb_dim=4, num_heads=2, head_dim=3, mlp_dim=5, mlp_activations=('relu',))
  assert flops.encoder_layer_macs(cfg, 6)['mlp'] == 6 * 4 * 5 + 6 * 5 * 4


@pytest.mark.parametrize('variant', ['coda_k_to_all', 'coda_k_to_k'])
@pytest.mark.parametrize('size', ['small', 'xl'])
def test_r_equal_one_is_parallel_adapter_plus_router(variant, size):
  cfg = t5_1_1(size)
  pa = flops.encoder_layer_macs(cfg, 384, variant='parallel_adapter')
  coda = flops.encoder_layer_macs(cfg, 384, variant=variant, reduction_factor=1)
  assert coda['router'] == 384 * cfg.emb_dim
  assert {k: v for k, v in coda.items() if k not in ('router', 'total')} == (
      {k: v for k, v in pa.items() if k not in ('router', 'total')})
  assert coda['total'] == pa['total'] + 384 * cfg.emb_dim


def test_multi_query_reduces_only_kv_projections():
  mha = t5_1_1('base')
  mqa = t5_1_1('base', num_kv_heads=1)
  gqa = t5_1_1('base', num_kv_heads=4)
  for variant, r in [('dense', 1), ('coda_k_to_all', 3), ('coda_k_to_k', 3)]:
    full = flops.encoder_layer_macs(mha, 512, variant=variant, reduction_factor=r)
    one = flops.encoder_layer_macs(mqa, 512, variant=variant, reduction_factor=r)
    four = flops.encoder_layer_macs(gqa, 512, variant=variant, reduction_factor=r)
    for name in ('k_proj', 'v_proj'):
      assert one[name] * 12 == full[name] and four[name] * 3 == full[name]
    for name in ('q_proj', 'logits', 'attn_v', 'out_proj', 'mlp', 'adapter', 'router'):
      assert one[name] == full[name] == four[name]
    assert one['total'] < four['total'] < full['total']


@pytest.mark.parametrize('attention', ['k_to_all', 'k_to_k'])
def test_bound_is_monotonic_in_r(attention):
  cfg = t5_1_1('small')
  bounds = [flops.encoder_speedup_bound(cfg, 1024, r, attention)
            for r in (1, 1.5, 2, 3, 4, 8, 16)]
  assert bounds[0] < 1  # r = 1 pays for the router
  assert all(a < b for a, b in zip(bounds, bounds[1:]))


def test_bound_against_n():
  cfg = t5_1_1('small')
  r = 3
  lengths = [3 * 2**i for i in range(4, 14)]  # 48 .. 24576, multiples of r
  to_all = [flops.encoder_speedup_bound(cfg, n, r, 'k_to_all') for n in lengths]
  to_k = [flops.encoder_speedup_bound(cfg, n, r, 'k_to_k') for n in lengths]
  assert all(a < b for a, b in zip(to_all, to_all[1:]))
  assert all(a < b for a, b in zip(to_k, to_k[1:]))
  # k-to-all tends to r from below; k-to-k passes r and tends to r**2.
  assert all(b < r for b in to_all) and to_all[-1] > 0.9 * r
  assert to_k[0] < r < to_k[-1] < r**2
  assert flops.encoder_speedup_bound(cfg, 3 * 2**22, r, 'k_to_k') > 0.95 * r**2
  assert all(a < b for a, b in zip(to_all, to_k))


def test_decoder_step_by_hand():
  # encoder_length 6, prefix 3, adapter 2, one decoder layer, vocab 10.
  step = flops.decoder_step_macs(TINY, 6, 3, adapter_dim=2)
  assert step == {
      'self_q_proj': 24, 'cross_q_proj': 24, 'self_k_proj': 12, 'cross_k_proj': 0,
      'self_v_proj': 12, 'cross_v_proj': 0, 'self_logits': 18, 'cross_logits': 36,
      'self_attn_v': 18, 'cross_attn_v': 36, 'self_out_proj': 24, 'cross_out_proj': 24,
      'mlp': 60, 'adapter': 16, 'logits_dense': 40, 'total': 344}
  uncached = flops.decoder_step_macs(TINY, 6, 3, adapter_dim=2, cross_kv_cached=False)
  assert uncached['cross_k_proj'] == uncached['cross_v_proj'] == 72
  assert uncached['total'] == 344 + 144
  assert flops.cross_kv_macs(TINY, 6) == 144
  no_adapter = flops.decoder_step_macs(TINY, 6, 3, adapter_dim=2, decoder_adapters=False)
  assert no_adapter['total'] == 344 - 16
  with pytest.raises(ValueError, match='prefix_length'):
    flops.decoder_step_macs(TINY, 6, 0)


def test_end_to_end_by_hand():
  # Decoder steps: prefix 1 -> 320, prefix 2 -> 332; cross k/v once: 144.
  pa = flops.end_to_end_macs(TINY, 6, 2, variant='parallel_adapter', adapter_dim=2)
  assert pa == {'encoder': 2 * 1320, 'cross_kv': 144, 'decoder': 652, 'total': 3436}
  coda = flops.end_to_end_macs(TINY, 6, 2, variant='coda_k_to_all', reduction_factor=4,
                               adapter_dim=2)
  assert coda == {'encoder': 2 * 624, 'cross_kv': 144, 'decoder': 652, 'total': 2044}
  assert flops.end_to_end_speedup_bound(TINY, 6, 2, 4, 'k_to_all', 2) == (
      pytest.approx(3436 / 2044))
  uncached = flops.end_to_end_macs(TINY, 6, 2, variant='parallel_adapter', adapter_dim=2,
                                   cross_kv_cached=False)
  assert uncached == {'encoder': 2640, 'cross_kv': 0, 'decoder': 652 + 2 * 144,
                      'total': 2640 + 652 + 288}


def test_end_to_end_bound_shrinks_with_output_length():
  cfg = t5_1_1('base')
  encoder = flops.encoder_speedup_bound(cfg, 384, 3, 'k_to_all')
  bounds = [flops.end_to_end_speedup_bound(cfg, 384, n_out, 3) for n_out in (1, 4, 32, 256)]
  assert encoder > bounds[0]
  assert all(a > b > 1 for a, b in zip(bounds, bounds[1:]))
  # Recomputing the cross-attention k/v at every step dilutes the bound further.
  assert flops.end_to_end_speedup_bound(cfg, 384, 32, 3, cross_kv_cached=False) < bounds[2]


def test_errors_name_the_wrong_thing():
  cfg = t5_1_1('small')
  with pytest.raises(ValueError, match="unknown variant 'coda'"):
    flops.encoder_layer_macs(cfg, 8, variant='coda')
  with pytest.raises(ValueError, match="'dense' processes every token"):
    flops.encoder_layer_macs(cfg, 8, variant='dense', reduction_factor=2)
  with pytest.raises(ValueError, match="unknown CoDA attention 'all'"):
    flops.encoder_speedup_bound(cfg, 8, 2, 'all')
  with pytest.raises(ValueError, match='adapter_dim'):
    flops.encoder_layer_macs(cfg, 8, variant='parallel_adapter', adapter_dim=0)
  with pytest.raises(ValueError, match='n must be'):
    flops.encoder_layer_macs(cfg, 0)


def test_acm_layer_macs_by_hand():
  cfg = T5Config(emb_dim=8, num_heads=2, head_dim=4, mlp_dim=16, mlp_activations=('gelu', 'linear'))
  n = 5
  dense = flops.encoder_layer_macs(cfg, n)
  acm = flops.acm_encoder_layer_macs(cfg, n, 0.5, num_learners=4, gate_dim=3)
  # FFN: 2 input projections + output = 3 * n * d * m, halved; gate d*g + g*g + g*(N+1).
  assert dense['mlp'] == 3 * n * 8 * 16
  assert acm['mlp'] == 3 * n * 8 * 16 // 2
  assert acm['gate'] == n * (8 * 3 + 3 * 3 + 3 * 5)
  attention = sum(dense[c] for c in ('q_proj', 'k_proj', 'v_proj', 'logits', 'attn_v',
                                     'out_proj'))
  assert acm['total'] == attention + acm['mlp'] + acm['gate']
  assert flops.acm_encoder_speedup_bound(cfg, n, 0.5, 4, 3) == dense['total'] / acm['total']
  with pytest.raises(ValueError, match='learners_used must be in'):
    flops.acm_encoder_layer_macs(cfg, n, 1.5)
