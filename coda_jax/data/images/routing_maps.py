"""Which patches CoDA's routers keep: the paper's Figure 6 on images, as numbers.

For an image model (`T5Config.encoder_input='patches'`) and its patch inputs
`[batch, n, 2 + 768]`, `routing_maps` runs the encoder and reads what each
routed layer sows (`network.RoutedEncoderLayer`: ``routing`` with the kept
positions ``indices [batch, k]`` and every patch's soft top-k weight
``weights [batch, n]``, λ, the router's preference). `grid` puts a patch
row of values back on the image's `rows x cols` grid of patches (row and
column ids), so a layer's weights draw as a heat map over the image.

The paper observes that the routers avoid whitespace: `ink` marks the patches
that are not a single flat colour (a patch with anything drawn in it), and
`ink_report` compares the share of a layer's kept patches that hold ink with
the ink's share of the image's patches; their ratio, ``ink_ratio``, is 1 for
a router blind to ink and up to n / k when every kept patch holds ink.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Tuple

import jax
import numpy as np

from coda_jax.data.images.patches import ID_COLUMNS

ROUTING_SOW = 'routing'
# A patch holds ink when its values (standardised) span more than this.
INK_TOLERANCE = 1e-3


@dataclasses.dataclass
class LayerMap:
  """One routed layer's decision on a batch of images.

  Attributes:
    layer: the layer's path ('encoder/layers_3').
    weights: `[batch, n]` float32, λ of every patch (0 on padding).
    kept: `[batch, n]` bool, the k patches the layer routes.
  """
  layer: str
  weights: np.ndarray
  kept: np.ndarray


def _layer_number(path: str) -> int:
  tail = path.rsplit('layers_', 1)[-1]
  return int(tail.split('/')[0]) if tail.split('/')[0].isdigit() else -1


def _decisions(tree, path: Tuple[str, ...] = ()):
  if not isinstance(tree, Mapping):
    return
  for key in tree:
    if key == ROUTING_SOW:
      yield '/'.join(path), tree[key][0]
    else:
      yield from _decisions(tree[key], path + (str(key),))


def routing_maps(model, params: Mapping[str, Any], patches: np.ndarray) -> List[LayerMap]:
  """Every routed encoder layer's `LayerMap` on `patches [batch, n, 2 + p]`,
  in layer order (the encoder run deterministically, as in evaluation).

  Raises:
    ValueError: a model that routes nothing, or one that reads tokens.
  """
  if model.config.encoder_input != 'patches':
    raise ValueError('routing_maps takes an image model (T5Config.encoder_input='
                     "'patches')")

  def run(params, patches):
    _, state = model.apply({'params': params}, patches, enable_dropout=False,
                           method=model.encode, mutable=['intermediates'])
    return {path: {'indices': d['indices'], 'weights': d['weights']}
            for path, d in _decisions(state.get('intermediates', {}))}

  found = jax.device_get(jax.jit(run)(params, np.asarray(patches, np.float32)))
  if not found:
    raise ValueError('the model sowed no routing decision: it has no routed encoder layer')
  out = []
  for path in sorted(found, key=_layer_number):
    indices = np.asarray(found[path]['indices'])
    kept = np.zeros(np.asarray(found[path]['weights']).shape, bool)
    np.put_along_axis(kept, indices, True, axis=1)
    out.append(LayerMap(path, np.asarray(found[path]['weights'], np.float32), kept))
  return out


def ink(patches: np.ndarray, tolerance: float = INK_TOLERANCE) -> np.ndarray:
  """bool `[..., n]`: real patches (row id > 0) whose values are not all equal
  (something is drawn in them; a blank patch of the page is flat)."""
  patches = np.asarray(patches)
  values = patches[..., ID_COLUMNS:]
  return (patches[..., 0] > 0) & (values.max(-1) - values.min(-1) > tolerance)


def ink_report(kept: np.ndarray, inked: np.ndarray, real: np.ndarray) -> Dict[str, float]:
  """Over a batch: the share of kept real patches that hold ink
  (``kept_ink_share``), the share of real patches that do (``ink_share``) and
  their ratio (``ink_ratio``; 0 when no patch holds ink)."""
  kept_real = kept & real
  kept_share = float((kept_real & inked).sum() / max(int(kept_real.sum()), 1))
  share = float(inked.sum() / max(int(real.sum()), 1))
  return {'kept_ink_share': kept_share, 'ink_share': share,
          'ink_ratio': kept_share / share if share else 0.0}


def grid(patches: np.ndarray, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
  """One example's per-patch `values [n]` on its `[rows, cols]` grid of
  patches (from the row and column ids of `patches [n, 2 + p]`; `fill`
  where no patch is)."""
  patches = np.asarray(patches)
  real = patches[:, 0] > 0
  rows = patches[real, 0].astype(int)
  cols = patches[real, 1].astype(int)
  out = np.full((int(rows.max(initial=0)), int(cols.max(initial=0))), fill, np.float32)
  out[rows - 1, cols - 1] = np.asarray(values)[real]
  return out
