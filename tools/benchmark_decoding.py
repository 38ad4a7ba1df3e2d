"""CoDA vs Parallel Adapter decoding latency (paper Fig. 7a, Table 12).

  python tools/benchmark_decoding.py                      # small, boolq + xsum cross-K/V row
  python tools/benchmark_decoding.py --tasks boolq,squad,xsum --batch_size 8
  python tools/benchmark_decoding.py --checkpoint PATH --decoding beam

Prints a table on stderr, writes JSON (--out) and a Figure 7a-style PNG;
`--json` also prints the JSON on stdout. See `coda_jax/benchmark.py`.
"""
import sys

from coda_jax import benchmark

if __name__ == '__main__':
  sys.exit(benchmark.main())
