"""What the decoding-latency benchmark compiles for a speech task (`--tasks librispeech`).

A speech model (`speech_network.SpeechTransducer`: audio rows `[batch,
frames, 1 + 80]` -> the 4x stem -> T5 encoder layers, CoDA-routed or the
Parallel Adapter's -> an RNN-T) is timed as the text models are: ONE encoder
per variant, ONE decoder shared by every variant (CoDA routes only in the
encoder; every variant's transducer has the same weights), end to end the
variant's encoder then the shared decoder. Its decoder is greedy transducer
decoding (`transducer_decoding.greedy_decode`: a scan over the encoder's
frames, in each a loop of at most N label steps, N = `max_symbols_per_frame`),
whose length depends on what the weights emit. So that it is fixed and the
same for every variant (random weights emit almost no blanks, a trained model
mostly blanks), the benchmark's transducer never takes the blank: its output
bias at the blank is `NEVER_BLANK_BIAS` (`never_blank`, as `NEVER_EOS` fixes
a text decoder's steps), and every encoder frame runs exactly N label steps
(the task's second number: `decoding_programs.TASK_SHAPES`), the most a greedy
search does.

Here:

* `make_transcribe_fn`: the shared decoder, `greedy_decode` of the encoder's
  `(encoded, lengths)`, N label steps a frame;
* for the TPU chip's model (`speech_chip`), greedy decoding in the two pieces
  the loop is made of (a compiler counts a loop's body once): `greedy_start`
  (the encoder projection W_h h + b_h of every frame, once, and the start
  symbol's prediction step) and `label_step` (one step of the loop's body:
  the joint, the best output, the labels and the prediction network's step,
  exactly `greedy_decode`'s); `label_step_floor`, the bytes a step must move;
* `encoder_frames`, and the shape a CPU runs by default (`CPU_FRAMES`,
  `CPU_BATCH`, `cpu_note`: what it says of it);
* the benchmark's flags for a speech model (`speech_model`, `check_args`).
"""
from __future__ import annotations

import argparse
import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from coda_jax.config import AUDIO, T5Config
from coda_jax.measure import models
from coda_jax.measure.bench.decoding_programs import SPEECH_TASKS, TASK_SHAPES
from coda_jax.model.speech import audio_input
from coda_jax.model.speech import transducer_decoding
from coda_jax.model.speech.transducer import Transducer

# The speech task (the paper's LibriSpeech fine-tuning, Table 8: 3200 input
# frames of 10 ms, 800 encoder frames after the 4x stem).
LIBRISPEECH = 'librispeech'
# The joint's output bias at the blank: no logit of the other outputs comes
# near it, so greedy decoding never takes the blank.
NEVER_BLANK_BIAS = -1e9
# On a CPU, by default (no --input_length, no --batch_size): a quarter of
# Table 8's input (200 encoder frames) and one utterance.
CPU_FRAMES = 800
CPU_BATCH = 1
# The paper's speech reduction factors (Table 5) and attention (§6).
REDUCTION_FACTORS = (2.0, 4.0)
ATTENTION = ('k_to_all',)
DECODING = ('greedy transducer decoding (transducer_decoding.greedy_decode), the blank '
            'never taken (the joint\'s output bias at the blank {bias:g}; the same '
            'transducer weights for every variant): every encoder frame runs exactly '
            '{steps} label steps')


def is_speech(config: T5Config) -> bool:
  """Whether `config` is a speech encoder's (audio rows in)."""
  return config.encoder_input == AUDIO


def encoder_frames(config: T5Config, frames: int) -> int:
  """The encoder's frames for `frames` input frames: ceil(frames / 4)."""
  return audio_input.encoder_length(config, frames)


def speech_model(args: argparse.Namespace) -> bool:
  """Whether the run's model reads audio: a speech preset, or 'tiny' for a
  speech task (never a --checkpoint)."""
  if args.checkpoint:
    return False
  if args.model == 'tiny':
    return args.input_length is None and any(t in SPEECH_TASKS for t in args.tasks)
  return args.model in models.SPEECH_PRESETS


def check_args(args: argparse.Namespace, model: str, tasks: Sequence[str]) -> bool:
  """`decoding_latency`'s check of the flags for a speech model (`model`: how
  the error messages name it; `tasks`: the tasks asked for, none with
  --input_length): a speech task needs a speech model and a speech model
  speech tasks; a speech model has no ACM rows, cross-attention K/V row or
  beam search (sets the ACM rows off by default). Whether the run's model is
  a speech model."""
  speech = [t for t in tasks if t in SPEECH_TASKS]
  if speech and not speech_model(args):
    raise ValueError(f'--tasks {speech[0]} is a speech task (audio frames in) and {model} '
                     f'is not a speech model; speech models: --model '
                     f'{", ".join(models.SPEECH_PRESETS)} or tiny')
  if not speech_model(args):
    return False
  other = [t for t in tasks if t not in SPEECH_TASKS]
  if other:
    raise ValueError(f'{model} is a speech model (audio frames in) and --tasks {other[0]} '
                     f'is not a speech task; speech tasks: {", ".join(SPEECH_TASKS)}')
  refused = [flag for flag, given in (('--acm_budgets', args.acm_budgets),
                                      ('--cross_kv', args.cross_kv),
                                      ('--decoding beam', args.decoding == 'beam')) if given]
  if refused:
    raise ValueError(f'{model} is a speech model: not with {", ".join(refused)} (its '
                     'decoder is greedy transducer decoding)')
  args.acm_budgets = []
  return True


def cpu_note(args: argparse.Namespace, on_cpu: bool) -> Optional[str]:
  """What a CPU run of a speech task chose instead of Table 8's shape (None
  where it did not)."""
  if not (on_cpu and speech_model(args) and args.input_length is None
          and args.batch_size is None):
    return None
  n_in, n_out = TASK_SHAPES[args.tasks[0]]
  return (f'on a CPU by default: {CPU_FRAMES} of Table 8\'s {n_in} input '
          f'frames, batch {CPU_BATCH} (--input_length {n_in} --output_length '
          f'{n_out} --batch_size B for the paper\'s length; --chip for its batch of 128 on a '
          "TPU chip's model)")


def task_record(config: T5Config, frames: int, symbols_per_frame: int) -> Dict[str, Any]:
  """What a speech task's JSON says of its shape and decoding."""
  n = encoder_frames(config, frames)
  return {'input_frames': frames, 'encoder_frames': n,
          'symbols_per_frame': symbols_per_frame, 'label_steps': n * symbols_per_frame,
          'decoding': DECODING.format(bias=NEVER_BLANK_BIAS, steps=symbols_per_frame)
                      + f' ({n} encoder frames, {n * symbols_per_frame} label steps)'}


def never_blank(params: Dict[str, Any], blank_id: int) -> Dict[str, Any]:
  """`params` of a SpeechTransducer with the joint's output bias at the blank
  set to `NEVER_BLANK_BIAS` (`transducer/joint/output_bias`, in its dtype)."""
  joint = params['transducer']['joint']
  bias = joint['output_bias'].at[blank_id].set(NEVER_BLANK_BIAS)
  return {**params, 'transducer': {**params['transducer'],
                                   'joint': {**joint, 'output_bias': bias}}}


def _transducer(model) -> Transducer:
  return Transducer(model.transducer, dtype=model.config.dtype)


def make_transcribe_fn(model, symbols_per_frame: int):
  """`(params, inputs, (encoded, lengths)) -> Decoded`: greedy decoding of
  `model`'s (a SpeechTransducer) encoder output, at most `symbols_per_frame`
  labels a frame, jitted; `inputs` unused (the text decoder's calling
  convention: `latency_task` calls both alike)."""
  rnnt = _transducer(model)

  def transcribe(params, inputs, encoded):
    del inputs
    return transducer_decoding.greedy_decode(rnnt, {'params': params['transducer']},
                                             encoded[0], encoded[1], symbols_per_frame)
  return jax.jit(transcribe)


# ----------------------------------------------------------------------------
# Greedy decoding's two pieces, for the chip's model.
# ----------------------------------------------------------------------------


def greedy_start(model, params: Any, encoded: jax.Array, symbols_per_frame: int
                 ) -> Tuple[jax.Array, Any]:
  """What `greedy_decode` does before its loop: the projected encoder frames
  `[frames, batch, J]` (W_h h + b_h, as the scan reads them) and the
  hypotheses after the start symbol (`params`: the transducer's)."""
  rnnt = _transducer(model)
  apply = functools.partial(rnnt.apply, {'params': params})
  batch, frames = encoded.shape[:2]
  projected = apply(encoded, method=Transducer.project_encoder)
  start = transducer_decoding._start(rnnt, apply, batch, frames * symbols_per_frame)  # pylint: disable=protected-access
  return jnp.swapaxes(projected, 0, 1), start


def label_step(model, params: Any, encoder_t: jax.Array, hyps: Any, active: jax.Array
               ) -> Tuple[Any, jax.Array]:
  """One step of `greedy_decode`'s loop over a frame (its `symbol`): the
  joint on the frame `encoder_t [batch, J]` and each row's prediction, the
  best output, its log-probability added where `active`, the label appended
  and the prediction network stepped where it is not the blank. Returns the
  hypotheses and which rows emitted (still active)."""
  rnnt = _transducer(model)
  apply = functools.partial(rnnt.apply, {'params': params})
  step = functools.partial(apply, method=Transducer.predict_step)
  log_probs = transducer_decoding._log_probs(apply, encoder_t, hyps.prediction)  # pylint: disable=protected-access
  best = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
  gained = jnp.take_along_axis(log_probs, best[:, None], axis=-1)[:, 0]
  hyps = hyps._replace(scores=hyps.scores + jnp.where(active, gained, 0.0))
  emit = active & (best != model.transducer.blank_id)
  return transducer_decoding._emit(hyps, best, emit, step), emit  # pylint: disable=protected-access


# The transducer's parameters a label step does not read: the encoder
# projection (`greedy_start` applies it to every frame once) and the label
# embedding table (a step reads the rows of its labels: 'embeddings').
_NOT_IN_A_STEP = ('joint/encoder_projection/', 'joint/bias', 'prediction/embed/')


def label_step_floor(model, batch: int, param_sizes: Dict[str, int],
                     param_dtype: Any = None) -> Dict[str, float]:
  """The bytes one label step of `batch` rows must move, by what they are
  (and 'total'): the transducer's parameters but the encoder projection and
  the embedding table, read once ('weights', `param_sizes` {name: elements}
  of its 'transducer/...' leaves, in `param_dtype`, default float32); the
  labels' embeddings ('embeddings'); the LSTM state (float32 c and h of every
  layer) and the projected prediction read and written, the frame's
  projection read ('state'); the hypotheses' scores, lengths and two hashes
  read and written, one label written and the active flags ('hypotheses').
  Activations in the model's dtype."""
  transducer = model.transducer
  act = jnp.dtype(model.config.dtype).itemsize
  weight = jnp.dtype(param_dtype or jnp.float32).itemsize
  weights = sum(size for name, size in param_sizes.items()
                if not any(part in name for part in _NOT_IN_A_STEP))
  lstm = transducer.lstm_layers * batch * transducer.lstm_dim * 4
  floor = {'weights': float(weights * weight),
           'embeddings': float(batch * transducer.embedding_dim * weight),
           'state': float(2 * 2 * lstm + 3 * batch * transducer.joint_dim * act),
           'hypotheses': float(batch * (2 * (4 + 4 + 8) + 4 + 2))}
  floor['total'] = sum(floor.values())
  return floor
