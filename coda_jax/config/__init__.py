"""Settings, in one place: one small gin-configurable dataclass per model part.

  t5         `T5Config` (t5x's field names, so gin files move between t5x and
             coda_jax unchanged), the encoder's input kinds, each layer
             kernel's setting
  presets    the models by name (`preset`, `t5_1_1`; `paper_coda`: the paper's
             CodaConfig for each): T5 v1.1, the paper's §6
             text and vision models, Pix2Struct, the §6 speech encoders,
             Whisper
  coda       `CodaConfig` with its `SoftTopKConfig`; the names the modules
             share (adapter types, attention variants, router normalisers,
             logical axes) and `k = ceil(n / r)`
  acm        `AcmConfig`, `AcmInferenceConfig`
  audio      `AudioConfig` (the log-mel front end), `SpecAugmentConfig`,
             `StemConfig` (speech's subsampling stem), `BestRqConfig`
             (BEST-RQ pre-training)
  speech     `TransducerConfig` (the RNN-T's prediction and joint networks)
  whisper    `WhisperFeaturesConfig` (Whisper's log-mel features), the
             constants of Whisper's log-mel normalisation, its parameters'
             logical axes
  serialize  `to_dict` / `from_dict`: configs as JSON

Every name is importable from `coda_jax.config`, and every config's gin name
is `coda_jax.config.<name>` (``from coda_jax import config`` then
``config.T5Config`` in a gin file). No flax import: this package is the
ground floor every other one stands on.
"""
from coda_jax.config.t5 import *  # noqa: F401,F403
from coda_jax.config.presets import *  # noqa: F401,F403
from coda_jax.config.coda import *  # noqa: F401,F403
from coda_jax.config.acm import *  # noqa: F401,F403
from coda_jax.config.serialize import *  # noqa: F401,F403
from coda_jax.config.audio import *  # noqa: F401,F403
from coda_jax.config.speech import *  # noqa: F401,F403
from coda_jax.config.whisper import *  # noqa: F401,F403
