"""CoDA vs Parallel Adapter decoding latency (paper Fig. 7a, Table 12).

  python tools/benchmark_decoding.py                      # small, boolq
  python tools/benchmark_decoding.py --tasks boolq,squad,xsum --batch_size 8
  python tools/benchmark_decoding.py --checkpoint PATH --decoding beam --strict

The same as ``coda-jax benchmark`` (see `coda_jax/measure/bench/decoding_latency.py`):
prints the table and the paths it wrote on stdout, writes JSON (--out) and a
Figure 7a-style PNG; `--json` prints the JSON on stdout instead (the table
then goes to stderr); `--strict` exits with status 1 when a target is missed.
"""
import sys

from coda_jax.cli import main

if __name__ == '__main__':
  sys.exit(main(['benchmark'] + sys.argv[1:]))
