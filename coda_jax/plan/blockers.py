"""What keeps each kernel from a call: one list per kernel, the plan's.

The plan reads these lists when it chooses (from the configs and the
program's shapes: `encoder.resolve`, `decoder.resolve_decoder`); a layer that
runs a kernel asserts the same list on its own call (`refuse`), so no layer
keeps a list of its own. Every argument says what a call asks of the kernel;
None or False: not asked (or not known where the list is read). The reasons
are the words the plan's `reasons` print. No flax here.
"""
from __future__ import annotations

from typing import FrozenSet, List, Optional, Sequence

from coda_jax.kernels import decode_attention as decode_attention_kernel
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.kernels import relpos_attention
from coda_jax.kernels import route_adapter
from coda_jax.kernels import slot_attention as slot_attention_kernel
from coda_jax.kernels import top_logits as top_logits_kernel
from coda_jax.kernels import tpu_blocks
from coda_jax.plan.rules import _ALTERNATIVE, SETTING


def attention(*, dropout: bool = False, packed: bool = False, bias: bool = False,
              cache: bool = False, kv_length: Optional[int] = None) -> List[str]:
  """The encoder's attention kernel (`kernels.relpos_attention`): T5's
  relative position bias (or none) and the padding of its queries' and keys'
  token masks, nothing else."""
  out = _attention_inputs(dropout, packed, cache, bias)
  if kv_length is not None and not relpos_attention.supported(kv_length):
    out.append(f'{kv_length} keys > {relpos_attention.MAX_KV_LENGTH}')
  return out


def _attention_inputs(dropout: bool, packed: bool, cache: bool,
                      bias: bool = False) -> List[str]:
  """What neither encoder attention formulation (the kernel, cuDNN's) takes:
  dropout on the attention weights, packed inputs, (the kernel) an extra
  bias, a decoding cache."""
  return [why for why, present in (('attention dropout', dropout),
                                   ('packed inputs (segment masks)', packed),
                                   ('an extra bias', bias),
                                   ('a decoding cache', cache)) if present]


# cuDNN's fused attention: the activation dtypes its flash attention takes,
# and the widest head (cuDNN 9's forward and backward on every GPU
# generation jax supports; Hopper's forward takes 256).
CUDNN_DTYPES = ('bfloat16', 'float16')
CUDNN_MAX_HEAD_DIM = 128


def fused_attention(*, dropout: bool = False, packed: bool = False, cache: bool = False,
                    dtype: Optional[str] = None, head_dim: Optional[int] = None,
                    native: bool = True) -> List[str]:
  """The encoder's attention through cuDNN (`jax.nn.dot_product_attention`,
  implementation 'cudnn'): the relative position bias as its bias and the
  padding as each row's number of real keys, at the end of the row. `native`:
  on a GPU (elsewhere jax's XLA implementation runs the call, any dtype)."""
  out = _attention_inputs(dropout, packed, cache)
  if native and dtype is not None and str(dtype) not in CUDNN_DTYPES:
    out.append(f'{dtype} activations (cuDNN takes {" or ".join(CUDNN_DTYPES)})')
  if native and head_dim is not None and (head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8):
    out.append(f'head_dim {head_dim} (cuDNN takes a multiple of 8 up to '
               f'{CUDNN_MAX_HEAD_DIM})')
  return out


def decode_attention(*, queries: Optional[int] = None, dropout: bool = False,
                     float32_logits: bool = False, bias: bool = False,
                     unmasked_padding: bool = False, acm: bool = False,
                     cross_cache: bool = True, fits: bool = True) -> List[str]:
  """A decoding step's cross-attention kernel (`kernels.decode_attention`):
  one query token a row over the cached heads-major keys/values, masked by
  the encoder's padding only."""
  out = []
  if float32_logits:
    out.append('float32 attention logits')
  if acm:
    out.append('an ACM attention')
  if not cross_cache:
    out.append('no cross-attention cache (cache_cross_kv=False)')
  if queries is not None and queries != 1:
    out.append(f'{queries} query tokens a row (a decoding step has one)')
  if bias:
    out.append('a bias')
  if unmasked_padding:
    out.append("a mask without the encoder's token mask (kv_token_mask)")
  if dropout:
    out.append('attention dropout')
  if not fits:
    out.append(f'its blocks do not fit {tpu_blocks.VMEM_BUDGET} B of VMEM')
  return out


def decode_attention_fits(batch: int, heads: int, kv_heads: int, head_dim: int,
                          length: int, dtype) -> bool:
  """Whether `kernels.decode_attention`'s blocks fit VMEM (`heads`: a row's
  query heads, beams x heads in beam search)."""
  return decode_attention_kernel.supported(batch, heads, kv_heads, head_dim, length, dtype)


def decode_keys(length: int) -> List[str]:
  """Padding a decoding step's cross-attention keys to whole 128-lane tiles
  (`T5Config.decode_keys` 'lane_padded'): nothing to pad where n fills them."""
  if length % tpu_blocks.LANES == 0:
    return [f'n = {length} is a multiple of {tpu_blocks.LANES}']
  return []


def beam_attention(*, float32_logits: bool = False, head_dim: Optional[int] = None,
                   beams: int = 0, cache_length: Optional[int] = None,
                   queries: Optional[int] = None, dropout: bool = False, fits: bool = True,
                   unknown_length: bool = False) -> List[str]:
  """Beam search's self-attention kernel (`kernels.slot_attention`): one query
  a row over the cache addressed by slot."""
  out = []
  if float32_logits:
    out.append('float32 attention logits')
  if head_dim is not None and head_dim % tpu_blocks.LANES:
    out.append(f'head_dim {head_dim} is not a multiple of {tpu_blocks.LANES} (the TPU '
               'keeps such a cache batch-minor)')
  if unknown_length:
    out.append('the cache length is unknown')
  elif not fits:
    out.append(f'{beams} slots of {cache_length} cached positions do not fit '
               f'{tpu_blocks.VMEM_BUDGET} B of VMEM')
  if queries is not None and queries != 1:
    out.append(f'{queries} query tokens a row (a decoding step has one)')
  if dropout:
    out.append('attention dropout')
  return out


def beam_attention_fits(batch: int, beams: int, heads: int, kv_heads: int, head_dim: int,
                        length: int, dtype) -> bool:
  return slot_attention_kernel.supported(batch, beams, heads, kv_heads, head_dim, length,
                                         dtype)


def mlp(*, lora: bool = False, acm: bool = False, dropout: bool = False,
        split: Sequence[str] = (), fits: bool = True, vmem_bytes: int = 0,
        layer_norm: bool = False, bias: bool = False) -> List[str]:
  """The MLP kernel (`kernels.mlp`): the pre-MLP RMS norm and T5's (gated)
  MLP without biases, its weights whole on each device."""
  out = norm_and_bias(layer_norm, bias)
  if lora:
    out.append('LoRA')
  if acm:
    out.append('an ACM MLP')
  if dropout:
    out.append('intermediate dropout')
  if split:
    out.append(f'{" and ".join(split)} split over devices')
  if not fits:
    out.append(f'its weights do not fit {vmem_bytes / 2 ** 20:g} MiB of VMEM')
  return out


def mlp_fits(rows: int, emb: int, hidden: int, projections: int, dtype, vmem_bytes: int,
             single_block: bool) -> bool:
  return mlp_kernel.fits((1, rows, emb), hidden, projections, dtype, vmem_bytes, single_block)


def lm_head(*, via_embedding: bool = False, split: Sequence[str] = (), rows: int = 0,
            k: int = 0, vocab: int = 0, fits: bool = True) -> List[str]:
  """Beam search's LM head kernel (`kernels.top_logits`): each row's top k
  logits and normaliser from the untied `logits_dense` kernel."""
  out = []
  if via_embedding:
    out.append('the logits come from the tied embedding (logits_via_embedding)')
  if split:
    out.append(f'the mesh splits the LM head ({", ".join(split)})')
  if not fits:
    out.append(f'{rows} rows and their top {k} of {vocab} do not fit '
               f'{tpu_blocks.VMEM_BUDGET} B of VMEM')
  return out


def lm_head_fits(rows: int, emb: int, vocab: int, k: int, dtype) -> bool:
  return top_logits_kernel.supported(rows, emb, vocab, k, dtype)


def norm_and_bias(layer_norm: bool = False, bias: bool = False) -> List[str]:
  """What keeps the kernels that compute T5's RMS norm or its bias-free
  projections (the MLP, route and output kernels) from Whisper's layers."""
  out = []
  if layer_norm:
    out.append("a LayerNorm (the kernel computes T5's RMS norm)")
  if bias:
    out.append('projection biases')
  return out


def route(*, adapter: bool = True, output_kernel: bool = False,
          split: FrozenSet[str] = frozenset(), fits: bool = True,
          layer_norm: bool = False) -> List[str]:
  """A routed layer's route kernel (`kernels.route_adapter`: the routed
  tokens' RMS-norm factors with the adapter's down projection)."""
  out = ([] if adapter else ['no parallel adapter']) + norm_and_bias(layer_norm)
  if output_kernel:
    out.append('the output kernel computes the adapter')
  if 'embed' in split:
    out.append('embed split over devices')
  if not fits:
    out.append(f'its [k, emb] accumulator does not fit {tpu_blocks.VMEM_BUDGET} B')
  return out


def route_fits(n: int, k: int, emb: int, itemsize: int) -> bool:
  return route_adapter.fits(n, k, emb, itemsize)


def refuse(what: str, why: Sequence[str]) -> None:
  """Raises ValueError if `why` (a list above, for the call at hand) is not
  empty: the plan gives the kernel of choice `what` only to calls it serves,
  so a layer asked to run it on another says what is wrong."""
  if why:
    raise ValueError(f"the {what} kernel ({SETTING[what]}={_ALTERNATIVE[what]!r}) cannot "
                     f"compute this call: {', '.join(why)}; use 'xla'")

