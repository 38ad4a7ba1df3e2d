"""The operands of `kernel_checks`' cases, and each kernel with its XLA
formulation on them: `BUILDERS[case.kernel](case, interpret)` (`case` a
`kernel_checks.Case`) gives
`(kernel, xla, args)`, two functions of the same float operands `args` (in
the case's dtype, as the layers pass them; integer operands such as routed
positions are closed over), or raises `Skip` where the case does not apply
to the chip here (said in its row)."""


def _positions(rng, batch: int, count: int, length: int):
  """Sorted distinct positions `[batch, count]` of `length` (all when equal)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  if count == length:
    return np.broadcast_to(np.arange(length), (batch, length)).astype(np.int32)
  return np.stack([np.sort(rng.choice(length, count, replace=False))
                   for _ in range(batch)]).astype(np.int32)


def _real(batch: int, length: int):
  """Every row real but the last, whose last third is padding."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  real = np.ones((batch, length), bool)
  real[-1, length - length // 3:] = False
  return real


def _attention_operands(case):
  """An attention case's queries, keys, values and relative position table
  in its dtype, and its positions and token masks (`kw`)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(0)
  b, q, kv, h, kvh, d = (s['batch'], s['queries'], s['keys'], s['heads'], s['kv_heads'],
                         s['head_dim'])
  scale = 0.05 if s.get('bias_only') else 1.0
  operands = [jnp.asarray(scale * rng.randn(b, n, heads, d), dtype)
              for n, heads in ((q, h), (kv, kvh), (kv, kvh))]
  # Far-apart bucket values: a pair put in the neighbouring bucket shows.
  # In the activation dtype, as the model's `RelativePositionBiases.table()`.
  table = jnp.asarray(rng.randn(h, s['buckets']) * (4.0 if s.get('bias_only') else 1.0),
                      dtype)
  if s['routed']:
    length = s['length']
    real = _real(b, length)
    q_pos = _positions(rng, b, q, length)
    k_pos = q_pos if kv == q else _positions(rng, b, kv, length)
    q_real = np.take_along_axis(real, q_pos, 1)
    k_real = np.take_along_axis(real, k_pos, 1)
  else:
    q_pos = k_pos = np.broadcast_to(np.arange(q), (b, q)).astype(np.int32)
    q_real = k_real = _real(b, q)
  kw = dict(query_positions=jnp.asarray(q_pos), key_positions=jnp.asarray(k_pos),
            query_real=jnp.asarray(q_real), key_real=jnp.asarray(k_real))
  return (*operands, table), kw


def _xla_attention(case, kw, query, key, value, table, bias_only: bool = False):
  """XLA's attention (`dot_product.dot_product_attention`, einsums) with the
  case's relative position bias and padding mask; `bias_only`: the bias
  alone `[b, heads, q, kv]` (0 without relative positions)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels.relpos import MASK_VALUE  # pylint: disable=g-import-not-at-top
  from coda_jax.model.attention import masks, position_bias  # pylint: disable=g-import-not-at-top
  from coda_jax.model.attention.dot_product import dot_product_attention  # pylint: disable=g-import-not-at-top
  s = case.shape
  bias = position_bias.RelativePositionBiases(
      num_buckets=s['buckets'], max_distance=s['max_distance'], num_heads=s['heads']).apply(
          {'params': {'rel_embedding': table}}, kw['query_positions'], kw['key_positions'])
  bias = bias if s.get('relative', True) else jnp.zeros((), table.dtype)
  if bias_only:
    return bias
  mask = masks.make_attention_mask(kw['query_real'], kw['key_real'])
  bias = jnp.where(mask > 0, 0., MASK_VALUE) + bias
  return dot_product_attention(query, key, value, bias=bias, deterministic=True,
                               dtype=query.dtype, float32_logits=True, form='einsums')


def _attention(case, interpret: bool):
  from coda_jax.kernels import relpos_attention  # pylint: disable=g-import-not-at-top
  s = case.shape
  args, kw = _attention_operands(case)
  relative = s.get('relative', True)

  def kernel(query, key, value, table):
    return relpos_attention.relpos_attention(query, key, value, table if relative else None,
                                             bidirectional=True,
                                             max_distance=s['max_distance'],
                                             interpret=interpret, **kw)

  def xla(query, key, value, table):
    return _xla_attention(case, kw, query, key, value, table)

  return kernel, xla, args


def _fused_attention(case, interpret: bool):
  """cuDNN's attention (`kernels.fused_attention`: the bias and the real keys'
  count per row) against XLA's with the dense mask, at the real queries (a
  padded query attends to the real keys with cuDNN, to every key with XLA's
  mask; nothing reads it)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import fused_attention  # pylint: disable=g-import-not-at-top
  from coda_jax.plan import blockers  # pylint: disable=g-import-not-at-top
  why = blockers.fused_attention(dtype=case.dtype, head_dim=case.shape['head_dim'],
                                 native=not interpret)
  if why:
    raise Skip(', '.join(why))
  args, kw = _attention_operands(case)
  lengths = jnp.sum(kw['key_real'], axis=-1, dtype=jnp.int32)
  real_queries = kw['query_real'][:, :, None, None]

  def kernel(query, key, value, table):
    bias = _xla_attention(case, kw, query, key, value, table, bias_only=True)
    bias = jnp.broadcast_to(bias, bias.shape[:-2] + (query.shape[1], key.shape[1]))
    out = fused_attention.fused_attention(query, key, value, bias.astype(query.dtype),
                                          lengths, interpret=interpret)
    return out * real_queries.astype(out.dtype)

  def xla(query, key, value, table):
    out = _xla_attention(case, kw, query, key, value, table)
    return out * real_queries.astype(out.dtype)

  return kernel, xla, args


def _mlp(case, interpret: bool):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.model.layers import get_activation  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import mlp as mlp_kernel  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(1)
  e, hidden, acts = s['emb'], s['mlp_dim'], s['activations']
  x = jnp.asarray(rng.randn(s['batch'], s['rows'], e), dtype)
  norm_scale = jnp.asarray(1 + 0.1 * rng.randn(e), dtype)
  wi = [jnp.asarray(rng.randn(e, hidden) / np.sqrt(e), dtype) for _ in acts]
  wo = jnp.asarray(rng.randn(hidden, e) / np.sqrt(hidden), dtype)
  functions = [get_activation(a) for a in acts]
  vmem = _vmem_bytes()
  if not s.get('resident', True):
    # The least VMEM in which the weights go in blocks of hidden units,
    # re-read per block of rows (the path large models take on a v4), or
    # read once with every row in one single-buffered block (a decoding
    # step's rows on a v4).
    single = bool(s.get('single_buffered'))
    fits = lambda v: mlp_kernel.plan(s['batch'], s['rows'], e, hidden, len(acts),
                                     dtype.itemsize, v, single)
    vmem = next((v for v in range(2 ** 20, vmem + 1, 2 ** 16)
                 if fits(v).fits and not fits(v).resident
                 and fits(v).single_buffered == single), None)
    if vmem is None:
      raise Skip(f'{hidden} hidden units have no split into blocks that fits VMEM '
                  'where the whole weights do not')

  def kernel(x, norm_scale, wi, wo):
    return mlp_kernel.mlp(x, norm_scale, wi, wo, functions, vmem_bytes=vmem,
                          single_block=bool(s.get('single_buffered')), interpret=interpret)

  def xla(x, norm_scale, wi, wo):
    return mlp_kernel.reference(x, norm_scale, wi, wo, functions, 1e-6)

  return kernel, xla, (x, norm_scale, wi, wo)


def _routed_operands(case, seed: int):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(seed)
  b, n, k, e, a = s['batch'], s['length'], s['k'], s['emb'], s['adapter']
  # Every float operand in the activation dtype, as the layers pass them.
  x = jnp.asarray(rng.randn(b, n, e), dtype)
  norm_scale = jnp.asarray(1 + 0.1 * rng.randn(e), dtype)
  w_down = jnp.asarray(rng.randn(e, a) / np.sqrt(e), dtype)
  w_up = jnp.asarray(rng.randn(a, e) / np.sqrt(a), dtype)
  indices = jnp.asarray(_positions(rng, b, k, n))
  delta = jnp.asarray(rng.randn(b, k, e), dtype)
  return x, norm_scale, w_down, w_up, delta, indices


def _route(case, interpret: bool):
  from coda_jax.kernels import route_adapter  # pylint: disable=g-import-not-at-top
  x, norm_scale, w_down, _, _, indices = _routed_operands(case, 2)

  def kernel(x, norm_scale, w_down):
    return route_adapter.route_adapter(x, norm_scale, w_down, indices, interpret=interpret)

  def xla(x, norm_scale, w_down):
    return route_adapter.reference(x, norm_scale, w_down, indices, 1e-6)

  return kernel, xla, (x, norm_scale, w_down)


def _output(case, interpret: bool):
  from coda_jax.model import adapters  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import unroute_combine  # pylint: disable=g-import-not-at-top
  x, norm_scale, w_down, w_up, delta, indices = _routed_operands(case, 3)
  activation = adapters.get_adapter_activation(case.shape['adapter_activation'])

  def kernel(x, norm_scale, w_down, w_up, delta):
    return unroute_combine.unroute_combine(x, norm_scale, w_down, w_up, delta, indices,
                                           activation=activation, interpret=interpret)

  def xla(x, norm_scale, w_down, w_up, delta):
    return unroute_combine.reference(x, norm_scale, w_down, w_up, delta, indices,
                                     activation, 1e-6)

  return kernel, xla, (x, norm_scale, w_down, w_up, delta)


def _soft_topk(case, interpret: bool):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.model import soft_topk  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import soft_topk as kernel_lib  # pylint: disable=g-import-not-at-top
  s = case.shape
  rng = np.random.RandomState(4)
  scores = jnp.asarray(2.0 * rng.randn(s['batch'], s['length']), jnp.float32)
  real = jnp.asarray(_real(s['batch'], s['length']))
  sched = soft_topk.epsilon_schedule(soft_topk.DEFAULTS.num_iters)

  def kernel(scores):
    return kernel_lib.soft_topk_iterative(scores, real, s['k'], sched,
                                          interpret=interpret)

  def xla(scores):
    return soft_topk._iterative(scores, real, s['k'], sched)  # pylint: disable=protected-access

  return kernel, xla, (scores,)


def _decode_attention(case, interpret: bool):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import decode_attention  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels.relpos import MASK_VALUE  # pylint: disable=g-import-not-at-top
  from coda_jax.model.attention.dot_product import dot_product_attention  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(6)
  b, n, h, kvh, d = s['batch'], s['keys'], s['heads'], s['kv_heads'], s['head_dim']
  # Queries of a model's spread (the logits about 1: the model divides its
  # query projection's initialisation by sqrt(head_dim)). At sqrt(head_dim)
  # rounding the logits to bfloat16 (the decoding step's dtype) moves the
  # outputs ~2% RMS, XLA's and the kernel's alike: no 1-2% bug would show.
  query = jnp.asarray(rng.randn(b, h, d) / np.sqrt(d), dtype)
  key = jnp.asarray(rng.randn(b, kvh, d, n), dtype)
  value = jnp.asarray(rng.randn(b, kvh, n, d), dtype)
  real = jnp.asarray(_real(b, n))

  def kernel(query, key, value):
    return decode_attention.decode_attention(query, key, value, real,
                                             key_block=s.get('key_block'), interpret=interpret)

  def xla(query, key, value):
    # In the operands' dtype: the reference runs this on them in float32.
    bias = jnp.where(real, 0., MASK_VALUE).astype(query.dtype)[:, None, None, :]
    return dot_product_attention(query[:, None], key, value, bias=bias, deterministic=True,
                                 dtype=query.dtype, kv_layout='heads_major',
                                 form='einsums')[:, 0]

  return kernel, xla, (query, key, value)


def _beam_attention(case, interpret: bool):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import slot_attention  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels.relpos import MASK_VALUE  # pylint: disable=g-import-not-at-top
  from coda_jax.model.attention.dot_product import dot_product_attention  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(7)
  b, beams, t, h, kvh, d = (s['batch'], s['beams'], s['cache'], s['heads'], s['kv_heads'],
                            s['head_dim'])
  rows = b * beams
  # Queries of a model's spread, as `_decode_attention`'s.
  query = jnp.asarray(rng.randn(rows, h, d) / np.sqrt(d), dtype)
  key = jnp.asarray(rng.randn(rows, kvh, d, t), dtype)
  value = jnp.asarray(rng.randn(rows, kvh, d, t), dtype)
  slots = jnp.asarray(rng.randint(0, beams, (b, beams, t)), jnp.int32)
  # The causal mask of a step at position 2t/3 (the rest masked) plus a
  # relative position bias, shared or per row.
  mask = np.where(np.arange(t) <= 2 * t // 3, 0., float(MASK_VALUE))
  bias = jnp.asarray(rng.randn(rows if s.get('bias_per_row') else 1, h, t) + mask, dtype)

  def kernel(query, key, value):
    return slot_attention.slot_attention(query, key, value, slots, bias, interpret=interpret)

  def xla(query, key, value):
    # Attention over the cache reordered by the slots (beam search's other
    # formulation, `decoding._gather_beams`).
    index = jnp.broadcast_to(slots[:, :, None, None, :], (b, beams, kvh, d, t))
    take = lambda x: jnp.moveaxis(jnp.take_along_axis(
        x.reshape(b, beams, kvh, d, t), index, axis=1).reshape(rows, kvh, d, t), -1, 1)
    return dot_product_attention(query[:, None], take(key), take(value),
                                 bias=bias[:, :, None, :], deterministic=True,
                                 dtype=query.dtype, form='einsums')[:, 0]

  return kernel, xla, (query, key, value)


def _lm_head(case, interpret: bool):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import top_logits  # pylint: disable=g-import-not-at-top
  s, dtype = case.shape, jnp.dtype(case.dtype)
  rng = np.random.RandomState(11)
  rows, k = s['batch'] * s['beams'], 2 * s['beams']
  x = jnp.asarray(rng.randn(rows, s['emb']), dtype)
  w = jnp.asarray(rng.randn(s['emb'], s['vocab']) / np.sqrt(s['emb']), dtype)

  def kernel(x, w):
    return top_logits.top_logits(x, w, k, vocab_block=s.get('vocab_block'), interpret=interpret)

  def xla(x, w):
    return top_logits.reference(x, w, k)

  return kernel, xla, (x, w)


class Skip(Exception):
  """A case that does not apply to this chip (said in its row)."""


BUILDERS = {'attention': _attention, 'mlp': _mlp, 'route': _route, 'output': _output,
             'soft_topk': _soft_topk, 'decode_attention': _decode_attention,
             'beam_attention': _beam_attention, 'lm_head': _lm_head,
             'fused_attention': _fused_attention}


def _vmem_bytes() -> int:
  """VMEM of a core of the chip here (the smallest TPU's elsewhere)."""
  from coda_jax.plan import target  # pylint: disable=g-import-not-at-top
  from coda_jax.kernels import tpu_blocks  # pylint: disable=g-import-not-at-top
  chip = target.current().chip
  return chip.vmem_bytes if chip is not None else tpu_blocks.SMALLEST_VMEM
