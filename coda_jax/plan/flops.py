"""Analytic multiply-accumulates (MACs) of dense vs CoDA T5 layers: the speed-up bound.

Only matrix multiplications are counted (1 MAC = 1 multiply + 1 add = 2 FLOPs).
Element-wise work is left out: RMS norms, activations, softmax, the relative
position bias lookup, residual adds, the gate `m * z`, gather/scatter and the
soft top-k iterations (T = 20 passes over n scores, O(n) each) are all O(n·d)
or less, negligible beside the O(n·d²) projections.

Notation (T5Config): d = emb_dim, H = num_heads, G = kv_heads (H: multi-head,
1: multi-query, between: grouped-query), dh = head_dim, m = mlp_dim,
w = len(mlp_activations) input projections of the MLP (2 for T5 v1.1's gated
GELU), a = adapter_dim, n = number of real input tokens, r = reduction factor,
k = ceil(n / r) (`coda_k`).

One encoder layer, with q = tokens that query and s = tokens that are keys/values:
  q_proj   q·d·H·dh       k_proj, v_proj   s·d·G·dh each
  logits   q·s·H·dh       attn_v           q·s·H·dh        out_proj  q·H·dh·d
  mlp      q·d·m·w + q·m·d
  adapter  2·n·d·a  (parallel adapter, on every token)
  router   n·d      (CoDA only: s = X_norm · w)
  dense:            q = s = n, no adapter, no router
  parallel_adapter: q = s = n, adapter
  coda_k_to_all:    q = k, s = n, adapter, router
  coda_k_to_k:      q = s = k, adapter, router
With r = 1 (k = n) both CoDA variants cost the parallel adapter plus the router.

The speech transducer (`speech_encoder_macs`, `transducer_greedy_macs`): the
4x stem's convolutions and projection (`stem_macs`), the layers above on its
ceil(frames / 4) frames (w = 1: Swish, not gated), no decoder; greedy RNN-T
decoding's matmuls (the encoder projection, then per label step the joint's
output layer, the LSTM and the prediction projection), the same for every
variant.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from coda_jax.config import (ATTENTION_VARIANTS, DEFAULT_ADAPTER_DIM, AcmConfig, StemConfig,
                             T5Config, TransducerConfig, coda_k)
from coda_jax.validation import positive_int

DENSE = 'dense'
PARALLEL_ADAPTER = 'parallel_adapter'
CODA_K_TO_ALL = 'coda_k_to_all'
CODA_K_TO_K = 'coda_k_to_k'
VARIANTS = (DENSE, PARALLEL_ADAPTER, CODA_K_TO_ALL, CODA_K_TO_K)
# The layer variant of each CoDA attention variant (paper §3.1).
VARIANT_OF_ATTENTION = dict(zip(ATTENTION_VARIANTS, (CODA_K_TO_ALL, CODA_K_TO_K)))

ENCODER_COMPONENTS = ('q_proj', 'k_proj', 'v_proj', 'logits', 'attn_v', 'out_proj',
                      'mlp', 'adapter', 'router')


def _attention_mlp_macs(config: T5Config, q: int, s: int, kv_proj_tokens: int
                        ) -> Dict[str, int]:
  """Attention (q queries over s keys; k/v projected for kv_proj_tokens) + MLP."""
  d, h, g, dh = config.emb_dim, config.num_heads, config.kv_heads, config.head_dim
  w = len(config.mlp_activations)
  return {
      'q_proj': q * d * h * dh,
      'k_proj': kv_proj_tokens * d * g * dh,
      'v_proj': kv_proj_tokens * d * g * dh,
      'logits': q * s * h * dh,
      'attn_v': q * s * h * dh,
      'out_proj': q * h * dh * d,
      'mlp': q * d * config.mlp_dim * w + q * config.mlp_dim * d,
  }


def _with_total(macs: Dict[str, int]) -> Dict[str, int]:
  macs = dict(macs)
  macs['total'] = sum(macs.values())
  return macs


def encoder_layer_macs(config: T5Config, n: int, *, variant: str = DENSE,
                       reduction_factor: float = 1.0,
                       adapter_dim: int = DEFAULT_ADAPTER_DIM,
                       num_routed_tokens: Optional[int] = None) -> Dict[str, int]:
  """MACs of one encoder layer on `n` real tokens.

  Args:
    variant: 'dense' | 'parallel_adapter' | 'coda_k_to_all' | 'coda_k_to_k'.
    reduction_factor: r of the CoDA variants (k = ceil(n / r)); must be 1 for
      the dense and parallel adapter variants.
    num_routed_tokens: k itself (a rung of k annealing), instead of r.

  Returns:
    MACs per component (`ENCODER_COMPONENTS`) and their 'total'.
  """
  if variant not in VARIANTS:
    raise ValueError(f'unknown variant {variant!r}; expected one of {VARIANTS}')
  n = positive_int(n, 'n')
  k = coda_k(n, reduction_factor)
  if num_routed_tokens is not None:
    k = min(n, positive_int(num_routed_tokens, 'num_routed_tokens'))
  adapter_dim = positive_int(adapter_dim, 'adapter_dim')
  if variant in (DENSE, PARALLEL_ADAPTER) and reduction_factor != 1:
    raise ValueError(f'variant {variant!r} processes every token; reduction_factor '
                     f'must be 1, got {reduction_factor!r}')
  d = config.emb_dim
  if variant == CODA_K_TO_ALL:
    macs = _attention_mlp_macs(config, q=k, s=n, kv_proj_tokens=n)
  elif variant == CODA_K_TO_K:
    macs = _attention_mlp_macs(config, q=k, s=k, kv_proj_tokens=k)
  else:
    macs = _attention_mlp_macs(config, q=n, s=n, kv_proj_tokens=n)
  macs['adapter'] = 0 if variant == DENSE else 2 * n * d * adapter_dim
  macs['router'] = n * d if variant in (CODA_K_TO_ALL, CODA_K_TO_K) else 0
  return _with_total(macs)


def _coda_variant(attention: str) -> str:
  if attention in VARIANT_OF_ATTENTION:
    return VARIANT_OF_ATTENTION[attention]
  if attention in VARIANT_OF_ATTENTION.values():
    return attention
  raise ValueError(f'unknown CoDA attention {attention!r}; expected one of '
                   f'{ATTENTION_VARIANTS}')


def encoder_macs(config: T5Config, n: int, *, variant: str = DENSE,
                 reduction_factor: float = 1.0,
                 adapter_dim: int = DEFAULT_ADAPTER_DIM) -> int:
  """MACs of the whole encoder, every layer of the same `variant`."""
  layer = encoder_layer_macs(config, n, variant=variant,
                             reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  return config.num_encoder_layers * layer['total']


def encoder_speedup_bound(config: T5Config, n: int, reduction_factor: float,
                          attention: str = 'k_to_all',
                          adapter_dim: int = DEFAULT_ADAPTER_DIM) -> float:
  """MACs(parallel adapter encoder) / MACs(CoDA encoder, every layer routed).

  `attention` is 'k_to_all' or 'k_to_k'. Over n divisible by r: for k-to-all
  the bound rises with n towards r and stays below it (k/v projections,
  adapter and router still see all n tokens); for k-to-k it rises with n
  towards r**2 (attention over k x k instead of n x n), passing r once the
  quadratic attention term outweighs the adapter and router.
  """
  coda = encoder_macs(config, n, variant=_coda_variant(attention),
                      reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  dense = encoder_macs(config, n, variant=PARALLEL_ADAPTER, adapter_dim=adapter_dim)
  return dense / coda


def decoder_step_macs(config: T5Config, encoder_length: int, prefix_length: int = 1,
                      *, adapter_dim: int = DEFAULT_ADAPTER_DIM,
                      cross_kv_cached: bool = True,
                      decoder_adapters: bool = True) -> Dict[str, int]:
  """MACs of the whole decoder for ONE new token (one greedy decoding step).

  Args:
    encoder_length: tokens of the encoder output attended by cross-attention.
    prefix_length: positions in the self-attention cache at this step,
      the new token included (1 at the first step).
    cross_kv_cached: the cross-attention keys/values of the encoder output
      are computed once per sequence (counted by `end_to_end_macs`), not here;
      False recomputes them at every step, as t5x does.
    decoder_adapters: a parallel adapter (2·d·a) in every decoder layer.

  Returns:
    Per-layer components summed over the decoder layers ('self_*', 'cross_*',
    'mlp', 'adapter'), 'logits_dense' (d·vocab) and 'total'.
  """
  encoder_length = positive_int(encoder_length, 'encoder_length')
  prefix_length = positive_int(prefix_length, 'prefix_length')
  adapter_dim = positive_int(adapter_dim, 'adapter_dim')
  d, layers = config.emb_dim, config.num_decoder_layers
  self_att = _attention_mlp_macs(config, q=1, s=prefix_length, kv_proj_tokens=1)
  cross = _attention_mlp_macs(config, q=1, s=encoder_length,
                              kv_proj_tokens=0 if cross_kv_cached else encoder_length)
  macs = {}
  for name in ('q_proj', 'k_proj', 'v_proj', 'logits', 'attn_v', 'out_proj'):
    macs[f'self_{name}'] = layers * self_att[name]
    macs[f'cross_{name}'] = layers * cross[name]
  macs['mlp'] = layers * self_att['mlp']
  macs['adapter'] = layers * 2 * d * adapter_dim if decoder_adapters else 0
  macs['logits_dense'] = d * config.vocab_size
  return _with_total(macs)


def cross_kv_macs(config: T5Config, encoder_length: int) -> int:
  """MACs of the cross-attention key/value projections of all decoder layers."""
  encoder_length = positive_int(encoder_length, 'encoder_length')
  return (config.num_decoder_layers * 2 * encoder_length * config.emb_dim *
          config.kv_heads * config.head_dim)


def end_to_end_macs(config: T5Config, n_in: int, n_out: int, *, variant: str,
                    reduction_factor: float = 1.0,
                    adapter_dim: int = DEFAULT_ADAPTER_DIM,
                    cross_kv_cached: bool = True) -> Dict[str, int]:
  """MACs of greedy decoding: the encoder once on `n_in` tokens, `n_out` decoder steps.

  Step t (1-based) attends over a self-attention prefix of t positions (the
  real prefix, not a padded cache). The decoder (dense, with parallel adapters
  unless `variant` is 'dense') is the same for every encoder variant: CoDA
  routes only in the encoder and its output keeps all n_in tokens.

  Returns:
    {'encoder', 'cross_kv', 'decoder', 'total'}; 'cross_kv' is the one-off
    key/value projection of the encoder output (0 when not cached, as it is
    then part of every decoder step).
  """
  n_out = positive_int(n_out, 'n_out')
  decoder_adapters = variant != DENSE
  decoder = sum(
      decoder_step_macs(config, n_in, t, adapter_dim=adapter_dim,
                        cross_kv_cached=cross_kv_cached,
                        decoder_adapters=decoder_adapters)['total']
      for t in range(1, n_out + 1))
  return _with_total({
      'encoder': encoder_macs(config, n_in, variant=variant,
                              reduction_factor=reduction_factor, adapter_dim=adapter_dim),
      'cross_kv': cross_kv_macs(config, n_in) if cross_kv_cached else 0,
      'decoder': decoder,
  })


def end_to_end_speedup_bound(config: T5Config, n_in: int, n_out: int,
                             reduction_factor: float, attention: str = 'k_to_all',
                             adapter_dim: int = DEFAULT_ADAPTER_DIM,
                             cross_kv_cached: bool = True, num_beams: int = 1) -> float:
  """MACs(parallel adapter) / MACs(CoDA) of decoding `n_out` tokens.

  Greedy by default; beam search (`num_beams` > 1) runs the decoder on
  `num_beams` rows per example, the encoder and the cross-attention
  key/value projections on one, so more beams bring the bound closer to 1.
  """
  num_beams = positive_int(num_beams, 'num_beams')

  def total(macs):
    return macs['encoder'] + macs['cross_kv'] + num_beams * macs['decoder']

  coda = end_to_end_macs(config, n_in, n_out, variant=_coda_variant(attention),
                         reduction_factor=reduction_factor, adapter_dim=adapter_dim,
                         cross_kv_cached=cross_kv_cached)
  dense = end_to_end_macs(config, n_in, n_out, variant=PARALLEL_ADAPTER,
                          adapter_dim=adapter_dim, cross_kv_cached=cross_kv_cached)
  return total(dense) / total(coda)


def cross_kv_speedup_bound(config: T5Config, n_in: int, n_out: int,
                           adapter_dim: int = DEFAULT_ADAPTER_DIM) -> float:
  """MACs of the Parallel Adapter decoder with the cross-attention keys/values
  recomputed at every step (t5x) over those with them computed once per sequence.

  The encoder is left out (the same in both); beams scale both alike.
  """
  def decoder(cross_kv_cached):
    macs = end_to_end_macs(config, n_in, n_out, variant=PARALLEL_ADAPTER,
                           adapter_dim=adapter_dim, cross_kv_cached=cross_kv_cached)
    return macs['cross_kv'] + macs['decoder']
  return decoder(False) / decoder(True)


def teacher_forced_decoder_macs(config: T5Config, n_in: int, n_out: int, *,
                                adapter_dim: int = DEFAULT_ADAPTER_DIM,
                                decoder_adapters: bool = True) -> int:
  """MACs of the decoder on `n_out` target tokens at once (training and
  scoring): causal self-attention over the n_out positions (the full n_out x
  n_out logits, as they are computed), cross-attention over `n_in` encoder
  tokens (their key/value projections included), the MLPs and the logits."""
  n_in = positive_int(n_in, 'n_in')
  n_out = positive_int(n_out, 'n_out')
  d = config.emb_dim
  self_att = _attention_mlp_macs(config, q=n_out, s=n_out, kv_proj_tokens=n_out)
  cross = _attention_mlp_macs(config, q=n_out, s=n_in, kv_proj_tokens=n_in)
  per_layer = (sum(v for k, v in self_att.items() if k != 'mlp')
               + sum(v for k, v in cross.items() if k != 'mlp') + self_att['mlp']
               + (2 * n_out * d * adapter_dim if decoder_adapters else 0))
  return config.num_decoder_layers * per_layer + n_out * d * config.vocab_size


def train_step_flops(config: T5Config, n_in: int, n_out: int, batch_size: int, *,
                     variant: str, num_routed_tokens: Optional[int] = None,
                     adapter_dim: int = DEFAULT_ADAPTER_DIM,
                     trains_backbone: bool = False) -> float:
  """FLOPs of one training step on a global batch: the forward pass (encoder
  at `num_routed_tokens` for a CoDA variant, teacher-forced decoder) times 2
  when the backbone is frozen (forward + the gradients of the activations;
  frozen weights get none) or 3 when every weight is trained (+ the weight
  gradients): the usual model-FLOPs convention, 2 FLOPs a MAC."""
  k = n_in if num_routed_tokens is None else int(num_routed_tokens)
  routed = variant in (CODA_K_TO_ALL, CODA_K_TO_K)
  encoder = config.num_encoder_layers * encoder_layer_macs(
      config, n_in, variant=variant, reduction_factor=n_in / k if routed else 1.0,
      adapter_dim=adapter_dim, num_routed_tokens=k if routed else None)['total']
  decoder = teacher_forced_decoder_macs(config, n_in, n_out, adapter_dim=adapter_dim,
                                        decoder_adapters=variant != DENSE)
  passes = 3 if trains_backbone else 2
  return 2.0 * passes * batch_size * (encoder + decoder)


# ----------------------------------------------------------------------------
# Adaptive Computation Modules.
# ----------------------------------------------------------------------------


def _acm_gate_macs(n: int, in_dim: int, gate_dim: int, num_learners: int) -> int:
  """One ACM gate on n tokens: in·g + g·g + g·(N + 1) per token."""
  return n * (in_dim * gate_dim + gate_dim * gate_dim + gate_dim * (num_learners + 1))


def acm_encoder_layer_macs(config: T5Config, n: int, learners_used: float,
                           num_learners: int = 4, gate_dim: int = 16, *,
                           modules: Sequence[str] = ('mlp',),
                           attention_learners_used: Optional[float] = None,
                           attention_rank_fraction: float = 1.0) -> Dict[str, int]:
  """MACs of one encoder layer whose FFN (and/or attention projections) are ACMs.

  'mlp' in `modules` (`coda_jax.model.acm.AcmMlp`): the FFN costs `learners_used`
  (the fraction of its N learners a token runs on average, i.e. the achieved
  budget) of the dense FFN. 'attention' (`acm.AcmLinear` on q/k/v/o): each
  projection in -> out is N low-rank learners of total rank R
  (`AcmConfig.attention_rank`), a token with k learners costs
  k/N · R·(in + out), so on average `attention_learners_used` (default
  `learners_used`) · R·(in + out) per token instead of in·out: with R =
  min(in, out) (`attention_rank_fraction=1`, exact) a square projection costs
  twice the dense one at k = N and breaks even at k = N/2; with fraction 1/2
  it breaks even at k = N. Every ACM adds its gate, `gate`: in·g + g·g +
  g·(N + 1) per token (in = d; the output projection's reads H·dh).
  Logits and attention-times-values stay dense.
  """
  if attention_learners_used is None:
    attention_learners_used = learners_used
  for name, value in (('learners_used', learners_used),
                      ('attention_learners_used', attention_learners_used)):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f'{name} must be in [0, 1], got {value!r}')
  modules = tuple(modules)
  acm = AcmConfig(num_learners=num_learners, modules=modules, gate_dim=gate_dim,
                  attention_rank_fraction=attention_rank_fraction)
  n = positive_int(n, 'n')
  d, h, g, dh = config.emb_dim, config.num_heads, config.kv_heads, config.head_dim
  macs = _attention_mlp_macs(config, q=n, s=n, kv_proj_tokens=n)
  gate = 0
  if 'mlp' in modules:
    macs['mlp'] = round(macs['mlp'] * learners_used)
    gate += _acm_gate_macs(n, d, gate_dim, num_learners)
  if 'attention' in modules:
    for name, (in_dim, out_dim) in (('q_proj', (d, h * dh)), ('k_proj', (d, g * dh)),
                                    ('v_proj', (d, g * dh)), ('out_proj', (h * dh, d))):
      rank = acm.attention_rank(in_dim, out_dim)
      macs[name] = round(n * rank * (in_dim + out_dim) * attention_learners_used)
      gate += _acm_gate_macs(n, in_dim, gate_dim, num_learners)
  macs['gate'] = gate
  return _with_total(macs)


def acm_encoder_speedup_bound(config: T5Config, n: int, learners_used: float,
                              num_learners: int = 4, gate_dim: int = 16,
                              **attention) -> float:
  """MACs(dense encoder layer) / MACs(ACM encoder layer) at budget `learners_used`
  (`attention`: `acm_encoder_layer_macs`'s keyword arguments)."""
  dense = encoder_layer_macs(config, n, variant=DENSE)['total']
  return dense / acm_encoder_layer_macs(config, n, learners_used, num_learners,
                                        gate_dim, **attention)['total']


def acm_ffn_fraction(acm: AcmConfig, tokens: int) -> float:
  """The fraction of the dense FFN's work the 'gather' capacities give on
  `tokens` tokens: Σ_n C_n / (N · tokens)."""
  return sum(acm.capacities(tokens)) / (acm.num_learners * tokens)


def acm_decoding_speedup_bounds(config: T5Config, acm: AcmConfig, n_in: int, n_out: int,
                                batch_size: int, num_beams: int = 1) -> Dict[str, Any]:
  """MACs(dense T5) / MACs(ACM) of decoding `n_out` tokens after an `n_in`-token encoder.

  The encoder's FFNs run `acm_ffn_fraction` of the dense work on its
  batch_size · n_in tokens (`acm_encoder_layer_macs`); each decoding
  step's on its batch_size · num_beams tokens; every ACM adds its gate
  (d·g + g·g + g·(N + 1) per token). Attention, the cross-attention K/V
  (once per example) and the logits are dense in both. Greedy: num_beams = 1.

  Returns:
    {'encoder', 'decoder', 'end_to_end'} bounds and the FFN fractions
    {'encoder_ffn_fraction', 'decoder_ffn_fraction'}.
  """
  beams = max(1, int(num_beams))
  enc_frac = acm_ffn_fraction(acm, batch_size * n_in)
  dec_frac = acm_ffn_fraction(acm, batch_size * beams)
  dense_enc = encoder_macs(config, n_in, variant=DENSE)
  acm_enc = dense_enc
  if acm.replaces('mlp', 'encoder'):
    acm_enc = config.num_encoder_layers * acm_encoder_layer_macs(
        config, n_in, enc_frac, acm.num_learners, acm.gate_dim)['total']
  gate = _acm_gate_macs(1, config.emb_dim, acm.gate_dim, acm.num_learners)
  dense_dec = acm_dec = 0.0
  for t in range(1, n_out + 1):
    step = decoder_step_macs(config, n_in, t, decoder_adapters=False)
    dense_dec += step['total']
    acm_dec += step['total']
    if acm.replaces('mlp', 'decoder'):
      acm_dec += step['mlp'] * (dec_frac - 1.0) + config.num_decoder_layers * gate
  cross = cross_kv_macs(config, n_in)
  dense_e2e = dense_enc + cross + beams * dense_dec
  acm_e2e = acm_enc + cross + beams * acm_dec
  return {'encoder': dense_enc / acm_enc, 'decoder': dense_dec / acm_dec,
          'end_to_end': dense_e2e / acm_e2e, 'encoder_ffn_fraction': enc_frac,
          'decoder_ffn_fraction': dec_frac}


# ----------------------------------------------------------------------------
# The speech transducer (`model.speech_network.SpeechTransducer`): the 4x
# stem, T5 encoder layers with a non-gated Swish FFN (w = 1, above), no
# decoder, greedy RNN-T decoding.
# ----------------------------------------------------------------------------


def _half(size: int) -> int:
  """A stride-2 convolution's output size with one zero of padding each
  side (`model.speech.stem`): ceil(size / 2)."""
  return -(-size // 2)


def stem_macs(frames: int, mels: int, stem: StemConfig, emb_dim: int) -> Dict[str, int]:
  """MACs of the 4x stem (`model.speech.stem.ConvSubsampling`) on one
  utterance of `frames` frames of `mels` log-mels, with C = `stem.channels`:
  conv_0 (3x3, 1 -> C) at every output of its ceil(frames / 2) x
  ceil(mels / 2) grid, conv_1 (3x3, C -> C) at every output of the grid
  halved again (T'' x M''), the projection T'' x (M'' C) x d; padding frames
  included (the compiled convolutions run over the whole array)."""
  frames, mels = positive_int(frames, 'frames'), positive_int(mels, 'mels')
  c = stem.channels
  t1, m1 = _half(frames), _half(mels)
  t2, m2 = _half(t1), _half(m1)
  return _with_total({'conv_0': t1 * m1 * 9 * c, 'conv_1': t2 * m2 * 9 * c * c,
                      'projection': t2 * m2 * c * emb_dim})


def speech_encoder_macs(config: T5Config, frames: int, stem: StemConfig, *,
                        variant: str = DENSE, reduction_factor: float = 1.0,
                        adapter_dim: int = DEFAULT_ADAPTER_DIM) -> Dict[str, int]:
  """MACs of a speech encoder on one utterance of `frames` input frames:
  the stem (`stem_macs`) and `config.num_encoder_layers` layers of `variant`
  on its n = ceil(frames / 4) frames (`encoder_layer_macs`, k = ceil(n / r);
  its FFN as `config.mlp_activations` says: one input projection for the
  paper's Swish). Returns {'stem', 'layers', 'total'}."""
  stem_total = stem_macs(frames, config.num_mels, stem, config.emb_dim)['total']
  n = _half(_half(positive_int(frames, 'frames')))
  layers = encoder_macs(config, n, variant=variant, reduction_factor=reduction_factor,
                        adapter_dim=adapter_dim)
  return _with_total({'stem': stem_total, 'layers': layers})


def speech_encoder_speedup_bound(config: T5Config, frames: int, stem: StemConfig,
                                 reduction_factor: float, attention: str = 'k_to_all',
                                 adapter_dim: int = DEFAULT_ADAPTER_DIM) -> float:
  """MACs(Parallel Adapter speech encoder) / MACs(CoDA's, every layer
  routed), the stem in both."""
  coda = speech_encoder_macs(config, frames, stem, variant=_coda_variant(attention),
                             reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  dense = speech_encoder_macs(config, frames, stem, variant=PARALLEL_ADAPTER,
                              adapter_dim=adapter_dim)
  return dense['total'] / coda['total']


def transducer_step_macs(transducer: TransducerConfig) -> Dict[str, int]:
  """MACs of one label step of greedy transducer decoding for one row
  (`model.speech.transducer_decoding`): the joint's output layer on the
  projected encoder frame and prediction (J x (V + 1)), then the prediction
  network's step on the label taken (its LSTM layers: E x 4H + H x 4H for the
  first, 2 x H x 4H for each other, and its projection H x J; the embedding
  is a lookup)."""
  e, h, j = transducer.embedding_dim, transducer.lstm_dim, transducer.joint_dim
  lstm = e * 4 * h + h * 4 * h + (transducer.lstm_layers - 1) * 2 * h * 4 * h
  return _with_total({'joint_output': j * transducer.num_outputs, 'lstm': lstm,
                      'prediction_projection': h * j})


def transducer_greedy_macs(config: T5Config, transducer: TransducerConfig, frames: int,
                           symbols_per_frame: int) -> Dict[str, int]:
  """MACs of greedy transducer decoding of one utterance whose encoder output
  has `frames` frames, each running `symbols_per_frame` label steps (the
  decoding loop's count when the blank is never taken: the cap): the
  encoder projection W_h h once per frame ('encoder_projection', d x J),
  the prediction network's step on the start symbol ('start') and the label
  steps ('steps', `transducer_step_macs`)."""
  frames = positive_int(frames, 'frames')
  steps = frames * positive_int(symbols_per_frame, 'symbols_per_frame')
  step = transducer_step_macs(transducer)
  return _with_total({
      'encoder_projection': frames * config.emb_dim * transducer.joint_dim,
      'start': step['lstm'] + step['prediction_projection'],
      'steps': steps * step['total']})


def speech_end_to_end_speedup_bound(config: T5Config, frames: int, stem: StemConfig,
                                    transducer: TransducerConfig, symbols_per_frame: int,
                                    reduction_factor: float, attention: str = 'k_to_all',
                                    adapter_dim: int = DEFAULT_ADAPTER_DIM) -> float:
  """MACs(Parallel Adapter) / MACs(CoDA) of transcribing `frames` input
  frames: the encoder (`speech_encoder_macs`), then greedy decoding
  (`transducer_greedy_macs`, the same for both: CoDA's encoder output keeps
  every frame)."""
  decoding = transducer_greedy_macs(config, transducer, _half(_half(frames)),
                                    symbols_per_frame)['total']
  coda = speech_encoder_macs(config, frames, stem, variant=_coda_variant(attention),
                             reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  dense = speech_encoder_macs(config, frames, stem, variant=PARALLEL_ADAPTER,
                              adapter_dim=adapter_dim)
  return (dense['total'] + decoding) / (coda['total'] + decoding)


# ----------------------------------------------------------------------------
# Whisper (`config.presets.WHISPER_SIZES`): its stem, the layers above on its
# ceil(frames / 2) positions (w = 1: an exact-GELU MLP, not gated), the
# decoder as T5's. Its biases, LayerNorms and positions are element-wise
# (O(n·d)) and, as the norms above, not counted.
# ----------------------------------------------------------------------------


def whisper_positions(frames: int) -> int:
  """Whisper's encoder positions for `frames` input frames: ceil(frames / 2)."""
  return _half(positive_int(frames, 'frames'))


def whisper_stem_macs(frames: int, mels: int, emb_dim: int) -> Dict[str, int]:
  """MACs of Whisper's stem (`model.speech.whisper_stem`) on one window of
  `frames` frames of `mels` log-mels: conv_0 (width 3, M -> d) at every
  frame, conv_1 (width 3, stride 2, d -> d) at each of ceil(frames / 2)
  positions; padding frames included (the convolutions run over the whole
  window)."""
  frames, mels = positive_int(frames, 'frames'), positive_int(mels, 'mels')
  return _with_total({'conv_0': frames * 3 * mels * emb_dim,
                      'conv_1': whisper_positions(frames) * 3 * emb_dim * emb_dim})


def whisper_decoding_macs(config: T5Config, frames: int, decode_steps: int, *,
                          variant: str = DENSE, reduction_factor: float = 1.0,
                          adapter_dim: int = DEFAULT_ADAPTER_DIM) -> Dict[str, int]:
  """MACs of transcribing one window of `frames` frames with `decode_steps`
  decoder steps (the forced prompt's tokens read one a step included): the
  stem ('stem'), the encoder layers of `variant` on n = ceil(frames / 2)
  positions ('encoder'), the cross-attention keys/values of n positions
  ('cross_kv') and the decoder steps ('decoder', `end_to_end_macs`)."""
  n = whisper_positions(frames)
  e2e = end_to_end_macs(config, n, decode_steps, variant=variant,
                        reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  stem = whisper_stem_macs(frames, config.num_mels, config.emb_dim)['total']
  return _with_total({'stem': stem, 'encoder': e2e['encoder'], 'cross_kv': e2e['cross_kv'],
                      'decoder': e2e['decoder']})


def whisper_speedup_bounds(config: T5Config, frames: int, decode_steps: int,
                           reduction_factor: float, attention: str = 'k_to_all',
                           adapter_dim: int = DEFAULT_ADAPTER_DIM) -> Dict[str, float]:
  """MACs(Parallel Adapter) / MACs(CoDA, every encoder layer routed) of
  Whisper (`whisper_decoding_macs`): 'encoder' (the stem and the layers)
  and 'end_to_end' (with the cross-attention keys/values and the decoder
  steps, the same in both)."""
  coda = whisper_decoding_macs(config, frames, decode_steps,
                               variant=_coda_variant(attention),
                               reduction_factor=reduction_factor, adapter_dim=adapter_dim)
  dense = whisper_decoding_macs(config, frames, decode_steps, variant=PARALLEL_ADAPTER,
                                adapter_dim=adapter_dim)
  encoder = lambda m: m['stem'] + m['encoder']
  return {'encoder': encoder(dense) / encoder(coda),
          'end_to_end': dense['total'] / coda['total']}
