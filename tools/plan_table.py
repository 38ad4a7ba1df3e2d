"""The committed plan evidence as one Markdown table.

  python tools/plan_table.py benchmarks/plan/*.json

One row per chip, input length and variant of each `tools/plan_evidence.py`
file: the kernels and dispatch the plan runs, the encoder's measure with
them (the file's `measure`: the TPU compiler's bytes accessed, GB, or the
roofline at the HBM traffic, ms) and, for each choice flipped to its other
formulation, how much more of it that program had (a negative number is a
faster flip: `tests/test_plan.py` allows one only where a rule runs it).
`benchmarks/plan/README.md` holds this table; a test checks it matches.
"""
from __future__ import annotations

import json
import sys
from typing import Iterable, List

CHOICES = ('attention', 'mlp', 'dispatch', 'route', 'output')


def _plan_of(program) -> str:
  plan = program['plan']
  layer = plan['routed'] or plan['dense']
  kernels = ', '.join(plan['kernels']) or 'none'
  return f'{layer["dispatch"]}; {kernels}' if plan['routed'] else kernels


# How each measure shows: its scale and unit.
UNITS = {'bytes_accessed': (1e-9, 'GB'), 'traffic_roofline_seconds': (1e3, 'ms')}


def rows(evidence) -> List[str]:
  """The table's rows of one evidence file."""
  measure = evidence.get('measure', 'bytes_accessed')
  scale, unit = UNITS[measure]
  out = []
  for variant in evidence['variants']:
    planned = variant['programs'][0]
    base = planned[measure]
    flips = {p['flipped']: p[measure] for p in variant['programs'][1:]}
    cells = [f'{100 * (flips[c] / base - 1):+.1f}%' if c in flips else ''
             for c in CHOICES]
    out.append('| ' + ' | '.join([
        evidence['chip'], str(variant['length']), variant['variant'],
        f'{variant["k"] / variant["length"]:.2f}', _plan_of(planned),
        f'{base * scale:.3f} {unit}'] + cells) + ' |')
  return out


def table(paths: Iterable[str]) -> str:
  header = ['chip', 'n', 'variant', 'k / n', 'plan: dispatch; kernels', 'measure'] + [
      f'{c} flipped' for c in CHOICES]
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  for path in paths:
    with open(path) as f:
      lines += rows(json.load(f))
  return '\n'.join(lines)


def main(argv=None) -> int:
  paths = sys.argv[1:] if argv is None else argv
  if not paths:
    print('usage: python tools/plan_table.py EVIDENCE.json [...]', file=sys.stderr)
    return 2
  print(table(paths))
  return 0


if __name__ == '__main__':
  sys.exit(main())
