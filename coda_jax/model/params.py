"""The parameter tree: its paths, its abstract shapes, and which leaves CoDA adds and trains.

Everything in coda_jax speaks one tree, the ``'params'`` collection of
`coda_jax.model.network.Transformer` (t5x's names), as a nested dict; paths are its
keys joined by ``/`` (``encoder/layers_0/attention/query/kernel``).

* `flatten` / `unflatten`: nested dict <-> ``{'a/b/c': leaf}``.
* `abstract_variables` / `abstract_params` / `param_shapes`: the tree a model
  has, as `jax.ShapeDtypeStruct`s, from one `jax.eval_shape` of its `init`
  (nothing allocated). This module holds the only dummy `init` of the package.
* `init_params`: real random parameters, optionally only some leaves (the new
  leaves of a CoDA model started from a T5 checkpoint), by a jitted init
  whose unused outputs XLA drops.
* The rule of which leaves CoDA adds to a T5 v1.1 tree (`is_new_leaf`:
  routers, adapters, LoRA factors) and which it trains (`is_trainable`: the
  new leaves and every layer norm, paper §3.2). `coda_jax.model.trainable`,
  `coda_jax.checkpoints` and `coda_jax.training.t5x_bridge` all derive from it.
"""
from __future__ import annotations

import functools
import re
from typing import (Any, Callable, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence,
                    Tuple)

import flax
import jax
import jax.numpy as jnp

from coda_jax.config import AUDIO, AUDIO_MASK_COLUMNS, PATCHES, WHISPER
from coda_jax.config import PATCH_ID_COLUMNS as ID_COLUMNS

PyTree = Any

# ----------------------------------------------------------------------------
# Paths.
# ----------------------------------------------------------------------------


def join(names: Iterable[str]) -> str:
  """Path components -> 'a/b/c'."""
  return '/'.join(names)


def split(path: str) -> Tuple[str, ...]:
  """'a/b/c' (or t5x's '/a/b/c') -> ('a', 'b', 'c')."""
  return tuple(p for p in path.split('/') if p)


def _key_name(key) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_names(key_path) -> Tuple[str, ...]:
  """A `jax.tree_util` key path (dict keys, attributes, indices) as strings."""
  return tuple(_key_name(k) for k in key_path)


def flatten(tree: Mapping[str, Any],
            is_leaf: Optional[Callable[[Any], bool]] = None) -> Dict[str, Any]:
  """Nested dict -> {'a/b/c': leaf}. Empty dicts are dropped.

  `is_leaf(node)` True keeps a mapping whole (e.g. a TensorStore spec).
  """
  out = {}

  def visit(prefix, node):
    if isinstance(node, Mapping) and not (is_leaf is not None and is_leaf(node)):
      for k, v in node.items():
        visit(prefix + (str(k),), v)
    else:
      out[join(prefix)] = node

  visit((), tree)
  return out


def unflatten(flat: Mapping[str, Any]) -> Dict[str, Any]:
  """{'a/b/c': leaf} -> nested dict (inverse of `flatten`)."""
  out: Dict[str, Any] = {}
  for name, leaf in flat.items():
    node = out
    *parents, last = split(name)
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = leaf
  return out


# ----------------------------------------------------------------------------
# Which leaves CoDA adds and trains (the one rule).
# ----------------------------------------------------------------------------

# Module name prefixes of what CoDA and ACM add to a T5 layer: `router`,
# `adapter`, `adapter_attention`, `adapter_mlp`, `acm_mlp`; and a speech
# model's `transducer` (`model.speech_network`: its prediction and joint
# networks are new in fine-tuning, on a backbone pre-trained without them).
NEW_MODULE_PREFIXES = ('adapter', 'router', 'acm', 'transducer')
# LoRA's factors, next to a pretrained projection's `kernel`.
LORA_LEAVES = ('lora_a', 'lora_b')
# Layer norms (`pre_attention_layer_norm`, `encoder_norm`, ...): pretrained,
# but trained in CoDA fine-tuning (paper §3.2).
NORM_SUFFIX = '_norm'


def is_new_component(name: str) -> bool:
  """Whether a path component names something a T5 v1.1 checkpoint lacks."""
  return name.startswith(NEW_MODULE_PREFIXES) or name in LORA_LEAVES


def is_new_leaf(names: Sequence[str]) -> bool:
  """Whether the leaf at `names` (path components) is one CoDA adds."""
  return any(is_new_component(n) for n in names)


# What a fine-tuning run trains: 'coda' (paper §3.2: the new leaves and the
# layer norms), or one of ACM's conversion phases: 'acm_distill' (the
# learners), 'acm_gate' (the gates), 'acm_finetune' (the whole model, as the
# ACM authors' phase 3, `acm_finetune_mode = 'entire_model'`, but the frozen
# teachers the ACMs replaced: `acm_teachers`), 'acm_finetune_acms' (learners,
# gates and layer norms: coda_jax's earlier phase 3).
TRAINABLE_SETS = ('coda', 'acm_distill', 'acm_gate', 'acm_finetune', 'acm_finetune_acms')
ACM_PREFIX = 'acm'
ACM_GATE = 'gate'


def acm_teachers(leaves: Iterable[Sequence[str]]) -> FrozenSet[Tuple[str, ...]]:
  """The leaves (path components) of the pretrained modules an ACM replaces.

  A module `x` with an `acm_x` sibling (`mlp` beside `acm_mlp`, an
  attention's `query` beside `acm_query`, ...) is the teacher of phases
  'distill' and 'gate' and runs no more in 'finetune': it stays, frozen.
  """
  leaves = [tuple(names) for names in leaves]
  acm_modules = {names[:i + 1] for names in leaves for i, n in enumerate(names)
                 if n.startswith(ACM_PREFIX + '_')}
  return frozenset(names for names in leaves
                   if any(names[:i] + (f'{ACM_PREFIX}_{n}',) in acm_modules
                          for i, n in enumerate(names)))


def is_trainable(names: Sequence[str], which: str = 'coda', teacher: bool = False) -> bool:
  """Whether the leaf at `names` trains in the `which` set (`TRAINABLE_SETS`).

  'coda': a new leaf (router, adapter, LoRA factor, ACM) or a layer norm;
  everything else is frozen. `teacher`: the leaf is one of `acm_teachers`
  (frozen in every set; only 'acm_finetune' would otherwise train it).
  """
  norm = any(n.endswith(NORM_SUFFIX) for n in names)
  if which == 'coda':
    return is_new_leaf(names) or norm
  if which not in TRAINABLE_SETS:
    raise ValueError(f'unknown trainable set {which!r}; expected one of {TRAINABLE_SETS}')
  acm = any(n.startswith(ACM_PREFIX) for n in names)
  gate = acm and ACM_GATE in names
  return {'acm_distill': acm and not gate, 'acm_gate': gate,
          'acm_finetune': not teacher, 'acm_finetune_acms': acm or norm}[which]


def new_component_regex() -> str:
  """A regular expression of one path component that `is_new_component` accepts."""
  prefixes = '|'.join(re.escape(p) for p in NEW_MODULE_PREFIXES)
  leaves = '|'.join(re.escape(n) for n in LORA_LEAVES)
  return rf'(?:(?:{prefixes})[^/]*|{leaves})'


# ----------------------------------------------------------------------------
# Abstract and real parameters of a model.
# ----------------------------------------------------------------------------

# Lengths of the dummy inputs `init` is traced with; the parameter shapes of
# a T5 (relative positions, no absolute ones) do not depend on them.
EXAMPLE_ENCODER_LENGTH = 8
EXAMPLE_DECODER_LENGTH = 4


def example_inputs(batch: int = 1, encoder_length: int = EXAMPLE_ENCODER_LENGTH,
                   decoder_length: int = EXAMPLE_DECODER_LENGTH, config=None):
  """(encoder tokens, decoder input tokens, decoder target tokens), all ones
  (with a `config` whose encoder reads patches, the encoder's input is
  `[batch, encoder_length, 2 + patch_dim]` ones: patch rows with ids 1; for
  audio and Whisper `[batch, encoder_length, 1 + num_mels]` ones: real frames)."""
  if config is not None and config.encoder_input in (PATCHES, AUDIO, WHISPER):
    enc = jnp.ones(encoder_input_spec(config, batch, encoder_length).shape, jnp.float32)
  else:
    enc = jnp.ones((batch, encoder_length), jnp.int32)
  dec = jnp.ones((batch, decoder_length), jnp.int32)
  return enc, dec, dec


def encoder_input_spec(config, batch: int, length: int) -> jax.ShapeDtypeStruct:
  """The encoder's input as a shape: `[batch, length]` int32 token ids, or
  for an image encoder (`T5Config.encoder_input` 'patches') `[batch, length,
  2 + patch_dim]` float32 patch rows; for audio (and Whisper) `[batch,
  length, 1 + num_mels]` float32 frames."""
  if config.encoder_input == PATCHES:
    return jax.ShapeDtypeStruct((batch, length, ID_COLUMNS + config.patch_dim), jnp.float32)
  if config.encoder_input in (AUDIO, WHISPER):
    return jax.ShapeDtypeStruct((batch, length, AUDIO_MASK_COLUMNS + config.num_mels),
                                jnp.float32)
  return jax.ShapeDtypeStruct((batch, length), jnp.int32)


def patches_of_row_ids(config, row_ids: jax.Array) -> jax.Array:
  """`[batch, n]` row ids -> `[batch, n, 2 + patch_dim]` float32 patch rows
  with those row ids and zeros elsewhere: all a decoder reads of an image's
  patches (which are real: row id > 0), for a program that takes the row
  ids alone (a decoding step, whose compiler drops the zeros)."""
  batch, n = row_ids.shape
  zeros = jnp.zeros((batch, n, ID_COLUMNS - 1 + config.patch_dim), jnp.float32)
  return jnp.concatenate([row_ids[..., None].astype(jnp.float32), zeros], axis=-1)


def rows_of_realness(config, realness: jax.Array) -> jax.Array:
  """`[batch, frames]` realness (1.0 real, 0.0 padding) -> Whisper's
  `[batch, frames, 1 + num_mels]` float32 rows with it in column 0 and zeros
  elsewhere: all a decoder reads of a window's frames (which positions are
  real), for a program that takes the realness alone (a decoding step,
  whose compiler drops the zeros)."""
  batch, frames = realness.shape
  zeros = jnp.zeros((batch, frames, AUDIO_MASK_COLUMNS - 1 + config.num_mels), jnp.float32)
  return jnp.concatenate([realness[..., None].astype(jnp.float32), zeros], axis=-1)


def _init(model, rng, encoder_length: int = EXAMPLE_ENCODER_LENGTH,
          decoder_length: int = EXAMPLE_DECODER_LENGTH):
  """`model.init` on dummy tokens: the one place a model is initialised."""
  return model.init(rng, *example_inputs(1, encoder_length, decoder_length,
                                         getattr(model, 'config', None)),
                    enable_dropout=False)


@functools.lru_cache(maxsize=32)
def _abstract_variables(model, encoder_length: int, decoder_length: int):
  return flax.core.unfreeze(jax.eval_shape(
      functools.partial(_init, model, encoder_length=encoder_length,
                        decoder_length=decoder_length), jax.random.PRNGKey(0)))


def abstract_variables(model, encoder_length: int = EXAMPLE_ENCODER_LENGTH,
                       decoder_length: int = EXAMPLE_DECODER_LENGTH) -> Dict[str, Any]:
  """`{'params': ..., 'params_axes': ...}` of `model` as `jax.ShapeDtypeStruct`s.

  One `jax.eval_shape` of `model.init` (cached per model and lengths); no
  array is allocated. `params_axes` holds the logical axis names.
  """
  tree = _abstract_variables(model, int(encoder_length), int(decoder_length))
  return jax.tree.map(lambda x: x, tree)  # a fresh container: callers may edit it


def abstract_params(model) -> Dict[str, Any]:
  """The parameter tree of `model` (the 'params' collection) as `ShapeDtypeStruct`s."""
  return abstract_variables(model)['params']


def param_shapes(model) -> Dict[str, Tuple[int, ...]]:
  """{'a/b/c': shape} of `model`'s parameters (nothing allocated)."""
  return {name: tuple(leaf.shape) for name, leaf in flatten(abstract_params(model)).items()}


def init_fn(model, only: Optional[Iterable[str]] = None) -> Callable[[jax.Array], Any]:
  """`rng -> parameters` of `model` (a nested dict), to jit (with shardings).

  With `only` (paths), just those leaves, as a flat {path: array}: under jit
  the rest of the initialisation is dead code XLA removes, so a large
  backbone's random weights are never materialised.
  """
  only = None if only is None else frozenset(only)

  def init(rng):
    params = flax.core.unfreeze(_init(model, rng)['params'])
    if only is None:
      return params
    return {name: leaf for name, leaf in flatten(params).items() if name in only}
  return init


@functools.lru_cache(maxsize=16)
def _jitted_init(model, only: Optional[frozenset]):
  return jax.jit(init_fn(model, only))


def init_params(model, rng: jax.Array, only: Optional[Iterable[str]] = None
                ) -> Dict[str, Any]:
  """Random parameters of `model` by one jitted `init_fn(model, only)`."""
  return _jitted_init(model, None if only is None else frozenset(only))(rng)


def from_pretrained(pretrained: Mapping[str, Any], model, rng: jax.Array, *,
                    filled: Iterable[str] = ()) -> Dict[str, Any]:
  """The flat parameters of `model`: every pretrained leaf from `pretrained`.

  Every leaf of `model` that `pretrained` (a tree) holds is taken from it
  (same path, checked shape); only the new leaves (`is_new_leaf`) are
  initialised, by a jitted init whose unused outputs XLA drops, so the
  backbone's random initialisation is never materialised. `filled`: new
  leaves the caller computes itself (ACM's learners, from the teacher's
  weights), neither initialised nor returned: a random initialisation
  thrown away costs its compile (a random generator per leaf: the init of
  the tests' tiny model with FFN and attention ACMs compiled in 13.4 s with
  its learners, 5.5 s without; XLA:CPU, 2-core AMD EPYC, jax 0.10.2) and,
  at T5 v1.1-XL's size, its memory.

  Raises:
    ValueError: a pretrained leaf of the model is missing from `pretrained`,
      has another shape, or `pretrained` holds a leaf the model does not have.
  """
  filled = frozenset(filled)
  shapes = param_shapes(model)
  given = flatten(pretrained)
  unexpected = sorted(set(given) - set(shapes))
  if unexpected:
    raise ValueError(f'checkpoint has {len(unexpected)} leaves the model does not: '
                     f'{unexpected[:5]}')
  new = []
  for name, shape in shapes.items():
    if name in given:
      if tuple(given[name].shape) != shape:
        raise ValueError(f'{name}: checkpoint shape {tuple(given[name].shape)} != '
                         f'model shape {shape}')
    elif is_new_leaf(split(name)):
      if name not in filled:
        new.append(name)
    else:
      raise ValueError(f'checkpoint is missing {name}')
  fresh = init_params(model, rng, only=new)
  return {name: given[name] if name in given else fresh[name] for name in shapes
          if name in given or name in fresh}
