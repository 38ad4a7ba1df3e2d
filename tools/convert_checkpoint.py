#!/usr/bin/env python3
"""Converts a T5 v1.1 checkpoint between formats; prints a JSON summary.

  python tools/convert_checkpoint.py INPUT OUTPUT --to {hf,t5x-legacy,t5x-orbax}
      [--dtype bfloat16] [--step N]
  python tools/convert_checkpoint.py MODEL_DIR --adapters DIR

The same as ``coda-jax convert`` (see `coda_jax.cli`): INPUT is anything
`coda_jax.checkpoints.load_t5_v1_1` reads (T5X legacy or orbax checkpoint or
model_dir, Hugging Face directory, a trained MODEL_DIR or one of its
``checkpoints/<step>``); ``--to hf`` writes its T5 v1.1 backbone as a Hugging
Face directory at OUTPUT, the T5X formats write OUTPUT/checkpoint_<step>/;
``--adapters DIR`` writes a trained MODEL_DIR's adapters, routers and layer
norms as an adapter-only directory.
"""
import sys

from coda_jax.cli import main

if __name__ == '__main__':
  sys.exit(main(['convert'] + sys.argv[1:]))
