"""Parameter counts of T5 v1.1 presets and of their CoDA models (JSON).

Counts come from `jax.eval_shape` (no weights allocated): the plain T5, the
CoDA model with `adapter_dim` (adapters in every encoder and decoder layer),
and its trainable part (adapters, routers, layer norms; paper §3.2). With
--adapter_file, also the bytes of the adapter-only file (`save_adapters`:
float32 trainable leaves + JSON) against the float32 frozen backbone.

  python tools/count_params.py [--sizes small,base,large,xl] [--adapter_dim 64]
      [--adapter_file]
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

from coda_jax import checkpoints
from coda_jax.model import params as params_lib
from coda_jax.model import trainable
from coda_jax.config import CodaConfig, t5_1_1
from coda_jax.model.network import Transformer


def adapter_file_bytes(coda_shapes, coda: CodaConfig) -> dict:
  """Writes the adapter-only file of a model of these shapes; its size in bytes."""
  flat = params_lib.flatten(coda_shapes)
  mask = params_lib.flatten(trainable.trainable_mask(coda_shapes))
  # Trainable leaves as real arrays; frozen ones are never written.
  params = {n: (np.full(s.shape, 0.01, np.float32) if mask[n] else np.zeros((1,), np.float32))
            for n, s in flat.items()}
  backbone = sum(4 * int(np.prod(s.shape)) for n, s in flat.items() if not mask[n])
  with tempfile.TemporaryDirectory() as tmp:
    out = checkpoints.save_adapters(params_lib.unflatten(params), coda,
                                    os.path.join(tmp, 'adapters'))
    size = {f: os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)}
  return {'files': size, 'frozen_backbone_bytes': backbone,
          'ratio': sum(size.values()) / backbone}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', default='small,base,large,xl')
  parser.add_argument('--adapter_dim', type=int, default=64)
  parser.add_argument('--adapter_file', action='store_true',
                      help='also write and measure the adapter-only file')
  args = parser.parse_args(argv)
  out = {}
  for size in [s for s in args.sizes.split(',') if s]:
    config = t5_1_1(size)
    coda_config = CodaConfig(adapter_dim=args.adapter_dim)
    coda = params_lib.abstract_params(Transformer(config, coda=coda_config))
    out[size] = {'t5': trainable.count_params(params_lib.abstract_params(Transformer(config))),
                 'coda': trainable.count_params(coda),
                 'coda_trainable': trainable.count_params(coda, trainable.trainable_mask)}
    if args.adapter_file:
      out[size]['adapter_file'] = adapter_file_bytes(coda, coda_config)
  print(json.dumps({'adapter_dim': args.adapter_dim, 'counts': out}, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
