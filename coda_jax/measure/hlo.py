"""Reading what XLA is given and what it makes: lowered StableHLO and compiled HLO text.

* `parse_hlo`: compiled HLO text -> its instructions and computations
  (`entry_computation`: its ENTRY's name; `opcode`, `operands`: of one
  instruction);
* `count_ops`: how many ops of one name a text holds, in either form
  (``stablehlo.while`` in `jax.jit(f).lower(...).as_text()`, ``while`` in
  `.compile().as_text()`);
* `find_ops` / `scatters`: the ops of one opcode in compiled HLO with the
  dtypes and shapes of their operands (e.g. a scatter whose destination is a
  `[batch, length, emb]` activation);
* `loop_dots`: the matmuls XLA left inside while-loop bodies (e.g. the
  cross-attention key/value projections of a decoding loop).

Compiled HLO is printed with instruction names unique in the module and
operands by name only, so shapes are read from the operands' definitions.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

_HLO_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$')
_HLO_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')
_HLO_ENTRY = re.compile(r'^ENTRY %?([\w.\-]+)', re.M)
_HLO_CALLEES = re.compile(
    r'(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)')
_HLO_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
# The opcode of an instruction: the first `name(` after its result type.
_HLO_OPCODE = re.compile(r'\s([a-z][\w\-]*)\(')
_HLO_ARRAY_TYPE = re.compile(r'^([a-z]+\d*)\[([\d,]*)\]')
# A StableHLO/MLIR operation: optional results `%0:3 = `, then the op name,
# possibly quoted in MLIR's generic form ("stablehlo.scatter"(...)).
_MLIR_OP = re.compile(r'^\s*(?:%[\w#:]+(?:\s*,\s*%[\w#:]+)*\s*=\s*)?"?([a-z_][\w.]*)"?[\s(<{]')


def parse_hlo(text: str) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
  """HLO text -> (instruction name -> its text, computation name -> instruction names).

  An instruction's text is what follows ``name = ``: its result type, opcode,
  operands and attributes.
  """
  instructions: Dict[str, str] = {}
  computations: Dict[str, List[str]] = {}
  current = None
  for line in text.splitlines():
    if line and not line[0].isspace():
      m = _HLO_COMPUTATION.match(line)
      current = m.group(1) if m else None
      if current:
        computations[current] = []
      continue
    m = _HLO_INSTR.match(line)
    if m:
      instructions[m.group(1)] = m.group(2)
      if current:
        computations[current].append(m.group(1))
  return instructions, computations


def opcode(instruction_text: str) -> Optional[str]:
  """The opcode of an HLO instruction's text (`parse_hlo`'s values): 'dot', 'while'..."""
  m = _HLO_OPCODE.search(instruction_text)
  return m.group(1) if m else None


def entry_computation(text: str) -> Optional[str]:
  """The name of compiled HLO's ENTRY computation (a key of `parse_hlo`'s
  computations), or None."""
  m = _HLO_ENTRY.search(text)
  return m.group(1) if m else None


def operands(instruction_text: str) -> List[str]:
  """The names of an HLO instruction's operands (`parse_hlo`'s values)."""
  m = _HLO_OPCODE.search(instruction_text)
  return _operand_names(instruction_text, m.end() - 1) if m else []


def _is_hlo(text: str) -> bool:
  return text.lstrip().startswith('HloModule')


def op_names(text: str) -> List[str]:
  """The name of every op in lowered StableHLO or compiled HLO text, in order.

  StableHLO names carry their dialect ('stablehlo.while', 'func.call');
  compiled HLO names are opcodes ('while', 'scatter', 'fusion').
  """
  if _is_hlo(text):
    instructions, _ = parse_hlo(text)
    return [op for op in map(opcode, instructions.values()) if op]
  return [m.group(1) for m in map(_MLIR_OP.match, text.splitlines()) if m]


def count_ops(text: str, name: str) -> int:
  """How many ops named `name` the text holds.

  `count_ops(jax.jit(f).lower(x).as_text(), 'stablehlo.while')`, or on
  compiled HLO `count_ops(compiled.as_text(), 'while')`. Ops in every
  function / computation count (loop bodies, fusions, called functions).
  """
  return sum(op == name for op in op_names(text))


class Operand(NamedTuple):
  name: str
  dtype: str  # 'f32', 's32', 'bf16', ...; 'tuple' for a tuple
  shape: Tuple[int, ...]  # () for a scalar or a tuple


class HloOp(NamedTuple):
  name: str
  opcode: str
  computation: Optional[str]
  dtype: str
  shape: Tuple[int, ...]
  operands: Tuple[Operand, ...]


def _array_type(text: str) -> Tuple[str, Tuple[int, ...]]:
  m = _HLO_ARRAY_TYPE.match(text)
  if not m:
    return 'tuple', ()
  return m.group(1), tuple(int(d) for d in m.group(2).split(',') if d)


def _operand_names(text: str, start: int) -> List[str]:
  """Names of the operands inside the parentheses opening at text[start]."""
  depth = 0
  for end in range(start, len(text)):
    depth += {'(': 1, ')': -1}.get(text[end], 0)
    if depth == 0:
      break
  return re.findall(r'%([\w.\-]+)', text[start:end])


def find_ops(hlo_text: str, name: str) -> List[HloOp]:
  """The instructions of opcode `name` in compiled HLO, with their operands' types.

  Operands are resolved through their definitions (instruction names are
  unique in an HLO module), so the shapes are those the op really sees: a
  scatter wrapped in a fusion reports the fusion's parameters.
  """
  instructions, computations = parse_hlo(hlo_text)
  where = {inst: comp for comp, insts in computations.items() for inst in insts}
  out = []
  for inst, text in instructions.items():
    m = _HLO_OPCODE.search(text)
    if not m or m.group(1) != name:
      continue
    operands = []
    for operand in _operand_names(text, m.end() - 1):
      dtype, shape = _array_type(instructions.get(operand, ''))
      operands.append(Operand(operand, dtype, shape))
    dtype, shape = _array_type(text)
    out.append(HloOp(inst, name, where.get(inst), dtype, shape, tuple(operands)))
  return out


def scatters(hlo_text: str) -> List[HloOp]:
  """The scatter ops of compiled HLO; `operands[0]` is the array scattered into."""
  return find_ops(hlo_text, 'scatter')


def _callees(text: str, to_apply: bool = True) -> List[str]:
  out = [c for c in _HLO_CALLEES.findall(text)
         if to_apply or not re.search(r'to_apply=%?' + re.escape(c) + r'\b', text)]
  for group in _HLO_BRANCHES.findall(text):
    out += [c.strip().lstrip('%') for c in group.split(',') if c.strip()]
  return out


def reachable(instructions: Mapping[str, str], computations: Mapping[str, List[str]],
              roots: Sequence[str], into: Callable[[str], bool] = lambda text: True,
              to_apply: bool = True) -> List[str]:
  """The computations reached from `roots` (theirs included, in visiting
  order) through calls, loop bodies and conditions, branches and, with
  `to_apply`, reductions' computations; not through an instruction for whose
  text `into` is False (e.g. fusions, to stay at the top level)."""
  seen: List[str] = []
  stack = list(roots)
  while stack:
    comp = stack.pop()
    if comp in seen or comp not in computations:
      continue
    seen.append(comp)
    for inst in computations[comp]:
      text = instructions[inst]
      if into(text):
        stack.extend(_callees(text, to_apply))
  return seen


CROSS_KV_OP = r'encoder_decoder_attention.*/(key|value)/'


def loop_dots(hlo_text: str, op_name_pattern: str = CROSS_KV_OP) -> int:
  """Matmuls inside while-loop bodies whose op_name matches `op_name_pattern`.

  The default pattern finds the cross-attention key/value projections of a
  compiled decoder; computations reached from a loop body (fusions,
  conditional branches) count too. 0 means the compiler hoisted them out of
  the decoding loop.
  """
  instructions, computations = parse_hlo(hlo_text)
  seen = reachable(instructions, computations,
                   [m.group(1) for text in instructions.values()
                    for m in [re.search(r'\bwhile\(.*\bbody=%?([\w.\-]+)', text)] if m])
  pattern = re.compile(op_name_pattern)
  count = 0
  for comp in seen:
    for inst in computations[comp]:
      text = instructions[inst]
      if opcode(text) == 'dot':
        m = re.search(r'op_name="([^"]+)"', text)
        if m and pattern.search(m.group(1)):
          count += 1
  return count
