"""The speech transducer's settings: `TransducerConfig` (the RNN-T prediction
and joint networks of `coda_jax.model.speech.transducer` and the decoding
cap of `coda_jax.model.speech.transducer_decoding`). No flax.

The paper (CoDA §6) says "a 2-layer LSTM Transducer [Graves, 2012]" and no
sizes; `lstm_layers = 2` is its, the other defaults (a 640-unit prediction
network and joint, a 128-dimensional label embedding, 4 symbols per frame)
are the common LibriSpeech RNN-T sizes (ContextNet / Conformer transducers),
not the paper's.
"""
from __future__ import annotations

import dataclasses

import gin

from coda_jax.config.t5 import GIN_MODULE
from coda_jax.validation import is_int, positive_int

# The logical axis of the joint network's hidden units (`model.speech.
# transducer`): replicated, so that its output kernel [joint, vocab] splits
# the outputs over the mesh's model axis as an LM head does.
JOINT_AXIS = 'joint'


@gin.configurable(module=GIN_MODULE)
@dataclasses.dataclass(frozen=True)
class TransducerConfig:
  """An RNN-T's prediction network, joint network and decoding cap.

  The output layer has `vocab_size + 1` entries: the `vocab_size` labels and
  the blank, at index `blank_id` (0 by default, so labels are then 1..V).
  Labels index the same table: a label id is any id in [0, vocab_size] other
  than `blank_id`. The prediction network reads the blank's embedding as its
  start symbol.
  """
  # V: the number of labels, blank excluded (the joint's output is V + 1 wide).
  vocab_size: int = 1024
  # The blank's index in the joint's output, in [0, vocab_size].
  blank_id: int = 0
  # The prediction network's label embedding.
  embedding_dim: int = 128
  # Units per LSTM layer of the prediction network, and its layers.
  lstm_dim: int = 640
  lstm_layers: int = 2
  # The joint network's hidden width (W_h h + W_g g, then tanh).
  joint_dim: int = 640
  # Decoding: at most this many labels in one encoder frame before the
  # search moves on to the next frame.
  max_symbols_per_frame: int = 4

  def __post_init__(self):
    for name in ('vocab_size', 'embedding_dim', 'lstm_dim', 'lstm_layers', 'joint_dim',
                 'max_symbols_per_frame'):
      object.__setattr__(self, name, positive_int(getattr(self, name),
                                                  f'TransducerConfig.{name}'))
    if not is_int(self.blank_id) or not 0 <= self.blank_id <= self.vocab_size:
      raise ValueError(f'TransducerConfig.blank_id must be an integer in [0, vocab_size = '
                       f'{self.vocab_size}], got {self.blank_id!r}')
    object.__setattr__(self, 'blank_id', int(self.blank_id))

  @property
  def num_outputs(self) -> int:
    """The joint's output width: the labels and the blank, V + 1."""
    return self.vocab_size + 1
