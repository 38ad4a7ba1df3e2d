"""Peak resident memory of `load_t5_v1_1` on a synthetic T5 v1.1 checkpoint.

Writes random float32 parameters of a preset (default base, 990 MB) in each
format asked for, then loads each in a fresh process under `/usr/bin/time -v`
and prints JSON: parameter bytes, peak RSS, and their ratio (this project's
target is < 2.5x). Baseline RSS of a process that only imports
coda_jax is reported too.

  python tools/measure_load_memory.py [--size base] [--formats t5x-legacy,hf,orbax]
      [--workdir /tmp/coda_mem]
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

from coda_jax import checkpoints
from coda_jax.model import network
from coda_jax.model import params as params_lib
from coda_jax.config import t5_1_1

WRITERS = {
    't5x-legacy': lambda p, c, d: checkpoints.save_t5x_legacy(p, d, step=1000000),
    'orbax': lambda p, c, d: checkpoints.save_t5x_orbax(p, d, step=1000000),
    'hf': lambda p, c, d: (checkpoints.save_hf(p, c, d), d)[1],
}
LOAD = ('import sys; from coda_jax import checkpoints; '
        'checkpoints.load_t5_v1_1(sys.argv[1])')
IMPORT_ONLY = 'from coda_jax import checkpoints'


def peak_rss_bytes(code: str, *args: str) -> int:
  proc = subprocess.run(['/usr/bin/time', '-v', sys.executable, '-c', code, *args],
                        capture_output=True, text=True, check=True)
  kb = re.search(r'Maximum resident set size \(kbytes\): (\d+)', proc.stderr)
  return int(kb.group(1)) * 1024


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size', default='base')
  parser.add_argument('--formats', default='t5x-legacy,hf,orbax')
  parser.add_argument('--workdir', default='/tmp/coda_mem')
  args = parser.parse_args(argv)
  config = t5_1_1(args.size)
  rng = np.random.default_rng(0)
  shapes = params_lib.param_shapes(network.Transformer(config))
  params = params_lib.unflatten({n: rng.standard_normal(s, dtype=np.float32)
                                 for n, s in shapes.items()})
  nbytes = sum(v.nbytes for v in params_lib.flatten(params).values())
  written = {}
  for fmt in [f for f in args.formats.split(',') if f]:
    written[fmt] = WRITERS[fmt](params, config, os.path.join(args.workdir, fmt))
  del params
  result = {'size': args.size, 'param_bytes': nbytes,
            'import_only_peak_rss': peak_rss_bytes(IMPORT_ONLY), 'formats': {}}
  for fmt, path in written.items():
    rss = peak_rss_bytes(LOAD, path)
    result['formats'][fmt] = {'path': path, 'peak_rss': rss, 'ratio': rss / nbytes}
  print(json.dumps(result, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
