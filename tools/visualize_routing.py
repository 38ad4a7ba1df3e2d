"""Which tokens each routed layer picks: the CoDA paper's Figure 6 for a trained model.

For a MODEL_DIR written by ``python -m coda_jax.train`` (its newest step or
--step) and a few inputs (a task's split, or a text/JSONL file as
``coda-jax infer`` reads), runs the encoder with ``mutable=['intermediates']``
and reads what the routers sow (`network.EncoderLayer`: ``routing`` holds the
selected positions ``indices [batch, k]`` and their gates ``gate [batch, k]``).
One PNG per example draws the tokens along x (each token decoded alone) and
the routed layers along y (one router per CoDA layer decides for its
attention and its MLP together); a routed token is marked with a dot and its
cell shaded by its gate λ. An ACM (`coda_jax.model.acm`: ``AcmStats`` sown under ``.../acm_mlp/acm``,
``.../attention/acm_query/acm``, ...) adds a row per module, shaded by each
token's number of learners k (a dot where k >= 1). ``index.html`` shows
every example's input, its tokens (shaded by how many rows routed them) and
its picture; ``routing.json`` the numbers drawn.

  python tools/visualize_routing.py --model_dir=/tmp/coda_quickstart \\
      --gin_file=gin_configs/runs/quickstart.gin --num_examples=4 --out_dir=/tmp/routing

The run's gin file (--gin_file, as for ``coda-jax infer``) gives the task, the
input length n the model was trained with (k = ceil(n / r) depends on it) and
the vocabulary; --task, --input_length and --vocabulary override it or stand
in for it. Prints a JSON summary of what it wrote.

An image model (Pix2Struct's patches, `coda_jax.data.images.tasks`; --inputs_file
then a JSONL of {"image": .., "question": ..}) is drawn as the paper draws
Figure 6: per example the image as the model reads it, then one panel per
routed layer with every patch's router weight λ as a heat map over the image
and the k kept patches outlined. The summary adds, per layer, how often the
kept patches hold ink against the ink's share of the image
(`coda_jax.data.images.routing_maps.ink_report`: the routers avoid whitespace when
``ink_ratio`` > 1).

A speech model (log-mels, `coda_jax.model.speech_network`; --inputs_file then
a JSONL of {"audio": ..}) is drawn per utterance as its log-mel spectrogram,
a strip of its tone frames (a generated DTMF utterance) and a strip per routed
layer marking its k kept encoder frames (4 input frames each); the titles and
the summary give each layer's kept tone frames per kept silence frame,
``kept_tone_to_silence``, beside ``tone_to_silence`` over all frames, and
``tone_ratio`` (tools/speech_quickstart.py measures and draws them,
`tone_report`: the routers skip silence when ``tone_ratio`` > 1).
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import importlib.util
import json
import os
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from coda_jax.model import acm as acm_lib

# What `network.EncoderLayer` sows its routing decision as.
ROUTING_SOW = 'routing'
# Row kinds: a CoDA router (values: gates λ of the routed tokens) or an ACM
# (values: each token's number of learners k).
GATE = 'gate'
LEARNERS = 'learners'
COLORMAPS = {GATE: 'Blues', LEARNERS: 'Oranges'}
VALUE_LABELS = {GATE: 'router gate λ (routed tokens)', LEARNERS: 'ACM learners k per token'}
UNSELECTED_RGBA = (0.93, 0.93, 0.93, 1.0)
# Shades start this far up the colour map, so that a routed token with a
# small gate still differs from an unrouted one.
MIN_SHADE = 0.15
# Diameter of the dot that marks a routed token, as a fraction of a cell.
MARKER_FRACTION = 0.35

DEFAULT_NUM_EXAMPLES = 4
DEFAULT_SPLIT = 'validation'
EOS_PIECE = '</s>'
# Figure geometry (inches) and resolution.
CELL_WIDTH_IN = 0.24
ROW_HEIGHT_IN = 0.42
LABEL_WIDTH_IN = 2.8
COLORBAR_WIDTH_IN = 1.3
COLORBAR_BAR_IN = 0.15
COLORBAR_PAD_IN = 0.75
COLORBAR_FIRST_PAD_IN = 0.1
MARGIN_HEIGHT_IN = 1.5
MIN_FIGURE_WIDTH_IN = 6.0
DPI = 130
TITLE_CHARS = 110
# index.html: a token routed by every row gets this opacity of blue.
HTML_MAX_ALPHA = 0.6
# Image panels (inches): per patch, at least this wide, room for a title; the
# heat map's opacity over the image.
IMAGE_PATCH_IN = 0.25
IMAGE_MIN_WIDTH_IN = 4.0
IMAGE_TITLE_IN = 0.6
HEAT_ALPHA = 0.6


@dataclasses.dataclass
class RoutingPicture:
  """What one example's picture draws: rows are the routed sublayers, columns
  the example's real tokens (EOS included, padding not drawn).

  Attributes:
    text: the input text.
    token_ids: [n] int32, the example's tokens.
    pieces: n strings, each token decoded alone (EOS as '</s>').
    length: the padded encoder length the model ran (k = ceil(length / r)).
    layer_names: L row names: 'encoder/layers_<i>' for a layer's router (its
      attention and MLP), the module's path for an ACM
      ('encoder/layers_<i>/acm_mlp', '.../attention/acm_query', ...).
    kinds: L of 'gate' (a router) or 'learners' (an ACM).
    selected: [L, n] bool: routed by the row's router; an ACM: k >= 1.
    values: [L, n] float32: a router's gate λ (0 where not routed); an ACM's
      number of learners k.
    value_max: [L] float32, the top of each row's colour scale (1 for gates,
      N learners for an ACM).
    padding_selected: [L] int32, slots of the row's k that fell on padding
      (an example shorter than k; their gate is 0), not drawn.
  """
  text: str
  token_ids: np.ndarray
  pieces: List[str]
  length: int
  layer_names: List[str]
  kinds: List[str]
  selected: np.ndarray
  values: np.ndarray
  value_max: np.ndarray
  padding_selected: np.ndarray

  def to_json(self) -> Dict[str, Any]:
    return {
        'text': self.text, 'pieces': self.pieces, 'length': self.length,
        'rows': [{'name': name, 'kind': kind,
                  'selected': np.flatnonzero(self.selected[r]).tolist(),
                  'values': [round(float(v), 4) for v in self.values[r]],
                  'padding_selected': int(self.padding_selected[r])}
                 for r, (name, kind) in enumerate(zip(self.layer_names, self.kinds))]}


# ----------------------------------------------------------------------------
# What the model sows, as plain numpy.
# ----------------------------------------------------------------------------


def encoder_intermediates(model, params, tokens: np.ndarray) -> Dict[str, Any]:
  """The 'intermediates' the encoder sows on `tokens [batch, length]` (0 =
  padding), deterministic (no dropout), as host numpy."""

  def run(params, tokens):
    _, state = model.apply({'params': params}, tokens, enable_dropout=False,
                           method=model.encode, mutable=['intermediates'])
    return state.get('intermediates', {})

  return jax.device_get(jax.jit(run)(params, np.asarray(tokens, np.int32)))


def routing_decisions(intermediates: Mapping[str, Any]
                      ) -> List[Tuple[str, np.ndarray, np.ndarray]]:
  """Every router's sown decision: (layer path, indices [batch, k], gate
  [batch, k]), in tree order."""
  found = []

  def visit(node, path):
    if not isinstance(node, Mapping):
      return
    for key in node:
      if key == ROUTING_SOW:
        for entry in node[key]:
          found.append(('/'.join(path), np.asarray(entry['indices']),
                        np.asarray(entry['gate'], np.float32)))
      else:
        visit(node[key], path + (str(key),))

  visit(intermediates, ())
  return found


def _row_order(name: str, kind: str) -> Tuple:
  """Rows by layer, then the router, the attention's ACMs, the MLP's ACM."""
  parts = name.split('/')
  layer = next((int(m.group(1)) for p in parts for m in [re.fullmatch(r'layers_(\d+)', p)]
                if m), -1)
  within = 0 if kind == GATE else (1 if acm_lib.module_kind(name) == 'attention' else 2)
  projection = next((acm_lib.ACM_PROJECTIONS.index(p) for p in parts
                     if p in acm_lib.ACM_PROJECTIONS), 0)
  return (parts[0], layer, within, projection, name)


def _acm_learners_per_token(name: str, learners: np.ndarray, length: int,
                            routers: Sequence[Tuple[str, np.ndarray, np.ndarray]]
                            ) -> np.ndarray:
  """An ACM's per-token learner counts over the `length` encoder positions:
  as sown ([batch, length]), or put back at the routed positions when the ACM
  sits inside a routed layer and saw only its k tokens ([batch, k])."""
  if learners.shape[1] == length:
    return learners
  owners = [(path, idx) for path, idx, _ in routers
            if name.startswith(path + '/') and idx.shape == learners.shape]
  if not owners:
    raise ValueError(f'the ACM at {name} sowed learners of shape {learners.shape}, '
                     f'neither [batch, {length}] nor the [batch, k] of a router above it')
  _, idx = max(owners, key=lambda o: len(o[0]))
  full = np.zeros((learners.shape[0], length), learners.dtype)
  np.put_along_axis(full, idx, learners, axis=1)
  return full


def token_pieces(vocabulary, ids: Sequence[int], eos_id: int = 1) -> List[str]:
  """Each token of `ids` decoded alone: a SentencePiece piece ('▁cat'), or
  the text of one id (a byte vocabulary's character); EOS as '</s>'."""
  processor = getattr(vocabulary, 'tokenizer', None)  # seqio's SentencePiece
  pieces = []
  for i in (int(i) for i in ids):
    if i == eos_id:
      pieces.append(EOS_PIECE)
    elif processor is not None and i < processor.get_piece_size():
      pieces.append(processor.id_to_piece(i))
    else:
      pieces.append(vocabulary.decode([i]))
  return pieces


def routing_pictures(model, params, tokens: np.ndarray, texts: Sequence[str], vocabulary,
                     intermediates: Optional[Mapping[str, Any]] = None
                     ) -> List[RoutingPicture]:
  """One `RoutingPicture` per row of `tokens [batch, length]` (left-aligned,
  0 = padding): what `model`'s routers (and ACMs) decide for each token.

  `intermediates`: the encoder's, if already computed (`encoder_intermediates`).
  """
  tokens = np.asarray(tokens, np.int32)
  batch, length = tokens.shape
  if intermediates is None:
    intermediates = encoder_intermediates(model, params, tokens)
  routers = routing_decisions(intermediates)
  acms = [(name, np.asarray(stats.learners))
          for name, stats in acm_lib.collect_named_stats(intermediates)]
  if not routers and not acms:
    raise ValueError('the model sowed no routing decision and no ACM statistics: it has '
                     'no routed encoder layer (CodaConfig) and no encoder ACM (AcmConfig)')
  num_learners = float(model.acm.num_learners) if getattr(model, 'acm', None) else 1.0
  rows = []  # (name, kind, selected [batch, length], values [batch, length], max)
  for name, idx, gate in routers:
    selected = np.zeros((batch, length), bool)
    np.put_along_axis(selected, idx, True, axis=1)
    values = np.zeros((batch, length), np.float32)
    np.put_along_axis(values, idx, gate, axis=1)
    rows.append((name, GATE, selected, values, 1.0))
  for name, learners in acms:
    full = _acm_learners_per_token(name, learners, length, routers)
    rows.append((name, LEARNERS, full > 0, full.astype(np.float32), num_learners))
  rows.sort(key=lambda row: _row_order(row[0], row[1]))

  pictures = []
  for b in range(batch):
    real = tokens[b] > 0
    n = int(real.sum())
    if not real[:n].all():
      raise ValueError(f'example {b}: its tokens must come first, then padding (0); got '
                       f'{tokens[b].tolist()}')
    ids = tokens[b, :n]
    pictures.append(RoutingPicture(
        text=texts[b], token_ids=ids, pieces=token_pieces(vocabulary, ids), length=length,
        layer_names=[r[0] for r in rows], kinds=[r[1] for r in rows],
        selected=np.stack([r[2][b, :n] for r in rows]),
        values=np.stack([r[3][b, :n] for r in rows]),
        value_max=np.asarray([r[4] for r in rows], np.float32),
        padding_selected=np.asarray([int(r[2][b, n:].sum()) if r[1] == GATE else 0
                                     for r in rows], np.int32)))
  return pictures


# ----------------------------------------------------------------------------
# Drawing.
# ----------------------------------------------------------------------------


def display_piece(piece: str) -> str:
  """A piece as the figure and the page show it: spaces visible."""
  if piece == EOS_PIECE:
    return piece
  return piece.replace(' ', '␣').replace('\n', '↵') or '∅'


def row_label(name: str, kind: str, k: Optional[int] = None) -> str:
  if kind == GATE:
    return f'{name} router{"" if k is None else f" k={k}"} (attention + mlp)'
  return f'{name} (ACM)'


def draw_picture(picture: RoutingPicture, path: str, title: str = '') -> str:
  """Writes `picture` as a PNG at `path` (matplotlib, Agg); returns `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import cm, colors  # pylint: disable=g-import-not-at-top
  from mpl_toolkits.axes_grid1 import make_axes_locatable  # pylint: disable=g-import-not-at-top

  rows, n = picture.selected.shape
  rgba = np.tile(np.asarray(UNSELECTED_RGBA, np.float32), (rows, n, 1))
  for r, kind in enumerate(picture.kinds):
    shade = MIN_SHADE + (1 - MIN_SHADE) * np.clip(
        picture.values[r] / max(float(picture.value_max[r]), 1e-9), 0, 1)
    rgba[r, picture.selected[r]] = plt.get_cmap(COLORMAPS[kind])(shade[picture.selected[r]])
  kinds = [k for k in (GATE, LEARNERS) if k in picture.kinds]
  width = max(MIN_FIGURE_WIDTH_IN,
              LABEL_WIDTH_IN + n * CELL_WIDTH_IN + COLORBAR_WIDTH_IN * len(kinds))
  height = MARGIN_HEIGHT_IN + rows * ROW_HEIGHT_IN
  fig, ax = plt.subplots(figsize=(width, height))
  ax.imshow(rgba, aspect='auto', interpolation='nearest')
  ys, xs = np.nonzero(picture.selected)
  # A routed token: a white dot ringed in black (seen on light and dark shades).
  ax.scatter(xs, ys, s=(72 * CELL_WIDTH_IN * MARKER_FRACTION) ** 2, marker='o',
             facecolors='white', edgecolors='black', linewidths=0.7, zorder=3)
  pieces = [display_piece(p) for p in picture.pieces]
  ax.set_xticks(range(n))
  labels = ax.set_xticklabels(pieces, fontsize=7, family='monospace')
  # Characters (a byte vocabulary) stand upright, longer pieces (and </s>) turn.
  for label, piece in zip(labels, picture.pieces):
    label.set_rotation(90 if len(display_piece(piece)) > 1 else 0)
  ks = [int(picture.selected[r].sum() + picture.padding_selected[r]) if kind == GATE else None
        for r, kind in enumerate(picture.kinds)]
  ax.set_yticks(range(rows))
  ax.set_yticklabels([row_label(name, kind, k) for name, kind, k
                      in zip(picture.layer_names, picture.kinds, ks)], fontsize=8)
  ax.set_xticks(np.arange(-0.5, n, 1), minor=True)
  ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
  ax.grid(which='minor', color='white', linewidth=1.0)
  ax.tick_params(which='minor', length=0)
  ax.set_xlabel(f'input tokens ({n} of n = {picture.length}; padding not drawn)')
  padded = [f'{name}: {int(p)}' for name, p in zip(picture.layer_names,
                                                    picture.padding_selected) if p]
  note = f'\nrouted padding slots (gate 0): {", ".join(padded)}' if padded else ''
  ax.set_title((title or picture.text)[:TITLE_CHARS] + note, fontsize=9, loc='left')
  divider = make_axes_locatable(ax)
  for i, kind in enumerate(kinds):  # one colour scale per kind of row, side by side
    top = max(float(m) for m, k in zip(picture.value_max, picture.kinds) if k == kind)
    mappable = cm.ScalarMappable(norm=colors.Normalize(0, top),
                                 cmap=colors.LinearSegmentedColormap.from_list(
                                     kind, plt.get_cmap(COLORMAPS[kind])(
                                         np.linspace(MIN_SHADE, 1, 64))))
    # The second scale leaves room for the first one's ticks and label.
    cax = divider.append_axes('right', size=COLORBAR_BAR_IN,
                              pad=COLORBAR_PAD_IN if i else COLORBAR_FIRST_PAD_IN)
    fig.colorbar(mappable, cax=cax, label=VALUE_LABELS[kind])
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


def write_html(pictures: Sequence[RoutingPicture], images: Sequence[str], path: str,
               heading: str) -> str:
  """``index.html``: per example its input, its tokens shaded by the share of
  rows that route them (hover: which rows) and its picture."""
  parts = ['<!DOCTYPE html>', '<html><head><meta charset="utf-8">',
           f'<title>{html.escape(heading)}</title>',
           '<style>body{font-family:sans-serif;margin:2em} '
           '.tok{font-family:monospace;padding:1px 2px;margin:1px;border:1px solid #ccc;'
           'display:inline-block;white-space:pre} img{max-width:100%}</style>',
           '</head><body>', f'<h1>{html.escape(heading)}</h1>']
  for i, (picture, image) in enumerate(zip(pictures, images)):
    rows = len(picture.layer_names)
    parts.append(f'<h2>Example {i}</h2><p>{html.escape(picture.text)}</p><p>')
    for t, piece in enumerate(picture.pieces):
      picked = [name for r, name in enumerate(picture.layer_names) if picture.selected[r, t]]
      alpha = HTML_MAX_ALPHA * len(picked) / max(rows, 1)
      tip = f'routed by {len(picked)} of {rows}: ' + ', '.join(picked)
      parts.append(f'<span class="tok" style="background:rgba(33,113,181,{alpha:.2f})" '
                   f'title="{html.escape(tip)}">{html.escape(display_piece(piece))}</span>')
    parts.append(f'</p><img src="{html.escape(os.path.basename(image))}" '
                 f'alt="routing of example {i}">')
  parts.append('</body></html>')
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(parts) + '\n')
  return path


def write_outputs(pictures: Sequence[RoutingPicture], out_dir: str, heading: str
                  ) -> Dict[str, Any]:
  """One PNG per example, ``index.html`` and ``routing.json`` in `out_dir`."""
  os.makedirs(out_dir, exist_ok=True)
  images = [draw_picture(p, os.path.join(out_dir, f'example_{i}.png'),
                         title=f'example {i}: {p.text}')
            for i, p in enumerate(pictures)]
  index = write_html(pictures, images, os.path.join(out_dir, 'index.html'), heading)
  numbers = os.path.join(out_dir, 'routing.json')
  with open(numbers, 'w') as f:
    json.dump([p.to_json() for p in pictures], f, indent=1)
  return {'images': images, 'index': index, 'numbers': numbers}


# ----------------------------------------------------------------------------
# Inputs and the command line.
# ----------------------------------------------------------------------------


def pad_examples(examples: Sequence[Mapping[str, Any]], length: int) -> np.ndarray:
  """The examples' 'inputs' token ids as `[batch, length]`, padded with 0."""
  tokens = np.zeros((len(examples), length), np.int32)
  for i, ex in enumerate(examples):
    ids = np.asarray(ex['inputs'], np.int32)[:length]
    tokens[i, :len(ids)] = ids
  return tokens


def task_examples(task, split: str, input_length: int, num_examples: int
                  ) -> List[Dict[str, Any]]:
  """The first `num_examples` of a seqio task's split, unshuffled."""
  if split not in task.splits:
    raise ValueError(f'task {task.name!r} has no split {split!r}; its splits: '
                     f'{list(task.splits)}')
  ds = task.get_dataset(sequence_length={'inputs': input_length, 'targets': input_length},
                        split=split, shuffle=False, num_epochs=1, use_cached=False)
  return list(ds.take(num_examples).as_numpy_iterator())


def _text(value) -> str:
  return value.decode('utf-8', 'replace') if isinstance(value, bytes) else str(value)


def _run_settings(gin_files: Sequence[str], model_dir: str) -> Dict[str, Any]:
  """Task name, module, input length and vocabulary from the run's gin files."""
  if not gin_files:
    return {}
  import gin  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  # A fine-tuning run file requires its starting checkpoint; the settings read
  # here do not depend on it.
  gin_utils.parse_gin(gin_files, [('MODEL_DIR', repr(model_dir)),
                                  ('INITIAL_CHECKPOINT_PATH', 'None')])
  settings = {}
  for key, macro in (('task', 'MIXTURE_OR_TASK_NAME'), ('module', 'MIXTURE_OR_TASK_MODULE'),
                     ('lengths', 'TASK_FEATURE_LENGTHS'), ('vocabulary', 'VOCABULARY')):
    try:
      value = gin.query_parameter(f'%{macro}')
    except ValueError:
      continue
    if hasattr(value, 'scoped_configurable_fn'):  # @seqio.ByteVocabulary() and the like
      value = value.scoped_configurable_fn()
    settings[key] = value
  return settings


def _vocabulary(spec: Optional[str], default):
  """--vocabulary: 'byte', 't5' or a SentencePiece model file; else `default`."""
  if spec is None and default is not None:
    return default
  import seqio  # pylint: disable=g-import-not-at-top
  from coda_jax.data import tasks  # pylint: disable=g-import-not-at-top
  if spec in (None, 't5'):
    return tasks.default_vocabulary()
  if spec == 'byte':
    return seqio.ByteVocabulary(extra_ids=tasks.DEFAULT_EXTRA_IDS)
  if not os.path.isfile(spec):
    raise ValueError(f"--vocabulary must be 'byte', 't5' or a SentencePiece model file; "
                     f'{spec!r} is none of these')
  return seqio.SentencePieceVocabulary(spec, extra_ids=tasks.DEFAULT_EXTRA_IDS)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model_dir', required=True,
                      help='a MODEL_DIR written by python -m coda_jax.train')
  parser.add_argument('--step', type=int, default=None, help='its checkpoint (default: newest)')
  parser.add_argument('--gin_file', action='append', default=[],
                      help="the run's gin file(s): task, input length, vocabulary")
  parser.add_argument('--task', default=None, help='a registered seqio task (default: the '
                      "gin file's MIXTURE_OR_TASK_NAME)")
  parser.add_argument('--split', default=DEFAULT_SPLIT)
  parser.add_argument('--inputs_file', default=None,
                      help='a text file (one input a line) or JSONL ({"inputs": ..}) '
                      'instead of the task')
  parser.add_argument('--num_examples', type=int, default=DEFAULT_NUM_EXAMPLES)
  parser.add_argument('--input_length', type=int, default=None,
                      help="n, the padded encoder length (default: the gin file's "
                      "TASK_FEATURE_LENGTHS['inputs'])")
  parser.add_argument('--vocabulary', default=None,
                      help="'byte', 't5' or a SentencePiece model file (default: the gin "
                      "file's VOCABULARY, else T5's)")
  parser.add_argument('--out_dir', default=None,
                      help='where the files go (default: MODEL_DIR/routing-<step>)')
  args = parser.parse_args(argv)
  if args.num_examples < 1:
    parser.error(f'--num_examples must be >= 1, got {args.num_examples}')
  if args.input_length is not None and args.input_length < 2:
    parser.error(f'--input_length must be >= 2, got {args.input_length}')
  return args


# ----------------------------------------------------------------------------
# Images: Figure 6 as the paper draws it.
# ----------------------------------------------------------------------------


def _seen_image(patches: np.ndarray) -> np.ndarray:
  """`[rows * 16, cols * 16, 3]` in [0, 1]: the image the patches hold (as
  the model reads it: resized, standardised, shown min to max)."""
  from coda_jax.data.images import routing_maps as image_routing  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images.patches import (ID_COLUMNS, PATCH_SIZE)  # pylint: disable=g-import-not-at-top
  shape = image_routing.grid(patches, np.zeros(len(patches))).shape
  real = patches[patches[:, 0] > 0]
  values = real[:, ID_COLUMNS:].reshape(shape + (PATCH_SIZE, PATCH_SIZE, 3))
  image = values.transpose(0, 2, 1, 3, 4).reshape(shape[0] * PATCH_SIZE,
                                                   shape[1] * PATCH_SIZE, 3)
  return (image - image.min()) / max(float(image.max() - image.min()), 1e-9)


def draw_image_routing(patches: np.ndarray, maps, b: int, path: str, title: str) -> str:
  """Example `b`'s image, then per routed layer its λ heat map over the
  image with the kept patches outlined; a PNG at `path`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from coda_jax.data.images import routing_maps as image_routing  # pylint: disable=g-import-not-at-top
  image = _seen_image(patches[b])
  rows, cols = image_routing.grid(patches[b], np.zeros(len(patches[b]))).shape
  panel = (max(IMAGE_MIN_WIDTH_IN, cols * IMAGE_PATCH_IN), rows * IMAGE_PATCH_IN
           + IMAGE_TITLE_IN)
  fig, axes = plt.subplots(len(maps) + 1, 1, squeeze=False,
                           figsize=(panel[0], panel[1] * (len(maps) + 1)))
  axes[0, 0].imshow(image)
  axes[0, 0].set_title(title[:TITLE_CHARS], fontsize=8, loc='left')
  for ax, layer in zip(axes[1:, 0], maps):
    heat = image_routing.grid(patches[b], layer.weights[b])
    ax.imshow(image, extent=(0, cols, rows, 0))
    shown = ax.imshow(heat, cmap='coolwarm', alpha=HEAT_ALPHA, extent=(0, cols, rows, 0),
                      vmin=0, vmax=1)
    kept = image_routing.grid(patches[b], layer.kept[b].astype(np.float32), fill=0)
    for y, x in zip(*np.nonzero(kept)):
      ax.add_patch(matplotlib.patches.Rectangle((x, y), 1, 1, fill=False, lw=0.8,
                                                 edgecolor='black'))
    ax.set_title(f'{layer.layer} router (k = {int(layer.kept[b].sum())} kept, outlined)',
                 fontsize=8, loc='left')
    fig.colorbar(shown, ax=ax, fraction=0.02, label='router weight λ')
  for ax in axes[:, 0]:
    ax.set_xticks([])
    ax.set_yticks([])
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return path


def image_inputs(task, args, input_length: int) -> Tuple[np.ndarray, List[str]]:
  """`[batch, n, 2 + 768]` patches and a caption per example: the task's
  split or --inputs_file (JSONL of images)."""
  from coda_jax.data.images import tasks as image_tasks  # pylint: disable=g-import-not-at-top
  if args.inputs_file is not None:
    examples = image_tasks.evaluation_examples(image_tasks.read_jsonl(
        args.inputs_file, answers=False))[:args.num_examples]
  else:
    examples = task_examples(task, args.split, input_length, args.num_examples)
  return (image_tasks.example_inputs(examples, input_length),
          [image_tasks.describe(ex) for ex in examples])


def run_images(loaded, task, args, input_length: int) -> Dict[str, Any]:
  """Figure 6 on images: one PNG per example, ``routing.json`` (per layer:
  each example's kept patches and weights) and the ink report per layer."""
  from coda_jax.data.images import routing_maps as image_routing  # pylint: disable=g-import-not-at-top
  patches, captions = image_inputs(task, args, input_length)
  maps = image_routing.routing_maps(loaded.model, loaded.params, patches)
  inked, real = image_routing.ink(patches), patches[..., 0] > 0
  out_dir = args.out_dir or os.path.join(loaded.model_dir or '.', f'routing-{loaded.step}')
  os.makedirs(out_dir, exist_ok=True)
  images = [draw_image_routing(patches, maps, b, os.path.join(out_dir, f'example_{b}.png'),
                               f'example {b}: {captions[b]}') for b in range(len(patches))]
  ink = {m.layer: image_routing.ink_report(m.kept, inked, real) for m in maps}
  numbers = os.path.join(out_dir, 'routing.json')
  with open(numbers, 'w') as f:
    json.dump({'ink': ink, 'examples': [
        {'input': captions[b], 'layers': {m.layer: {
            'kept': np.flatnonzero(m.kept[b]).tolist(),
            'weights': [round(float(v), 4) for v in m.weights[b]]} for m in maps}}
        for b in range(len(patches))]}, f, indent=1)
  return {'model_dir': loaded.model_dir, 'step': loaded.step, 'input_length': input_length,
          'num_examples': len(patches), 'rows': [m.layer for m in maps], 'ink': ink,
          'out_dir': out_dir, 'images': images, 'numbers': numbers}


# ----------------------------------------------------------------------------
# Audio: kept encoder frames under the spectrogram (tools/speech_quickstart.py).
# ----------------------------------------------------------------------------


def _speech_quickstart():
  """tools/speech_quickstart.py: its routing and tone measurement."""
  spec = importlib.util.spec_from_file_location(
      'speech_quickstart', os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        'speech_quickstart.py'))
  if spec.name not in sys.modules:
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])
  return sys.modules[spec.name]


def run_audio(loaded, task, args, input_length: int) -> Dict[str, Any]:
  """Figure 6 on speech: one PNG per utterance, ``routing.json`` and the
  tone report per layer (generated DTMF utterances only)."""
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  speech = _speech_quickstart()
  if args.inputs_file is not None:
    examples = audio_tasks.evaluation_examples(audio_tasks.read_jsonl(
        args.inputs_file, text=False))[:args.num_examples]
  elif task.name in audio_tasks.GENERATED:  # their descriptions: the tone frames
    examples = speech.task_examples(task.name, args.split, args.num_examples)
  else:
    examples = task_examples(task, args.split, input_length, args.num_examples)
  found = speech.utterance_routing(loaded.model, loaded.params, examples, input_length)
  out_dir = args.out_dir or os.path.join(loaded.model_dir or '.', f'routing-{loaded.step}')
  os.makedirs(out_dir, exist_ok=True)
  images = [speech.draw_utterance_routing(found, b, os.path.join(out_dir, f'example_{b}.png'),
                                          f'example {b}: {found["captions"][b]}')
            for b in range(len(examples))]
  numbers = os.path.join(out_dir, 'routing.json')
  with open(numbers, 'w') as f:
    json.dump({'tone': found['reports'], 'examples': [
        {'input': found['captions'][b], 'layers': {name: {
            'kept': np.flatnonzero(layer['kept'][b]).tolist(),
            'weights': [round(float(v), 4) for v in layer['weights'][b]]}
                                                  for name, layer in found['layers'].items()}}
        for b in range(len(examples))]}, f, indent=1)
  return {'model_dir': loaded.model_dir, 'step': loaded.step, 'input_length': input_length,
          'num_examples': len(examples), 'rows': list(found['layers']),
          'tone': found['reports'], 'out_dir': out_dir, 'images': images, 'numbers': numbers}


def run(args: argparse.Namespace) -> Dict[str, Any]:
  """Loads the model and the inputs, draws them; returns the JSON summary."""
  from coda_jax.inference import infer  # pylint: disable=g-import-not-at-top
  from coda_jax.training import data as data_lib  # pylint: disable=g-import-not-at-top
  loaded = infer.load_model(args.model_dir, args.step)
  settings = _run_settings(args.gin_file, args.model_dir)
  input_length = args.input_length or (settings.get('lengths') or {}).get('inputs')
  if not input_length:
    raise ValueError('the input length n is unknown: give --input_length or the run\'s '
                     '--gin_file (its TASK_FEATURE_LENGTHS)')
  task_name = args.task or settings.get('task')
  task = None
  if args.inputs_file is None or task_name:
    if not task_name:
      raise ValueError('no inputs: give --task (or the run\'s --gin_file) or --inputs_file')
    task = data_lib.prepare_task(task_name, settings.get('vocabulary') if args.vocabulary
                                 is None else _vocabulary(args.vocabulary, None),
                                 modules=[settings.get('module')])
  if loaded.model.config.encoder_input == 'patches':
    return run_images(loaded, task, args, int(input_length))
  if loaded.model.config.encoder_input == 'audio':
    return run_audio(loaded, task, args, int(input_length))
  vocabulary = (data_lib.output_vocabulary(task) if task is not None
                else _vocabulary(args.vocabulary, settings.get('vocabulary')))
  if args.inputs_file is not None:
    examples = infer.read_input_file(args.inputs_file, vocabulary,
                                     int(input_length))[:args.num_examples]
    source = {'inputs_file': args.inputs_file}
  else:
    examples = task_examples(task, args.split, int(input_length), args.num_examples)
    source = {'task': task_name, 'split': args.split}
  if not examples:
    raise ValueError(f'no examples to draw from {source}')
  tokens = pad_examples(examples, int(input_length))
  texts = [_text(ex.get('inputs_pretokenized', '')) or vocabulary.decode(
      data_lib.trim_at_eos(ex['inputs'])) for ex in examples]
  pictures = routing_pictures(loaded.model, loaded.params, tokens, texts, vocabulary)
  out_dir = args.out_dir or os.path.join(loaded.model_dir or '.', f'routing-{loaded.step}')
  heading = f'Routing of {loaded.source["checkpoint"]} (step {loaded.step})'
  written = write_outputs(pictures, out_dir, heading)
  return {'model_dir': loaded.model_dir, 'step': loaded.step, **source,
          'input_length': int(input_length), 'num_examples': len(pictures),
          'rows': pictures[0].layer_names, 'kinds': pictures[0].kinds,
          'out_dir': out_dir, **written}


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parse_args(argv)
  from coda_jax import checkpoints  # pylint: disable=g-import-not-at-top
  from coda_jax.training import gin_utils  # pylint: disable=g-import-not-at-top
  try:
    summary = run(args)
  except (ValueError, checkpoints.CheckpointError, gin_utils.GinError) as e:
    print(f'visualize_routing: error: {gin_utils.own_message(e)}', file=sys.stderr)
    return 2
  print(json.dumps(summary, indent=1, default=str))
  return 0


if __name__ == '__main__':
  sys.exit(main())
