"""The decoding-latency result as people read it: a table and a Figure 7a-style plot.

Under each task's rows (and under its ACM block's), a line per variant gives
its encoder's plan (`coda_jax.plan`: how its token dispatch, attention, MLP,
route, output and soft top-k run, `Plan.summary`), from its row's ``plan``.
"""
from __future__ import annotations

import json
from typing import Any, List, Mapping, Optional, Sequence


def table_lines(title: str, head: str) -> List[str]:
  """A table's opening lines: a blank line, its title, its column header and
  a rule as wide as the header."""
  return ['', title, head, '-' * len(head)]


def write_json(result: Mapping[str, Any], path: Optional[str], indent: int = 1) -> str:
  """`result` as JSON text, also written to `path` (with a final newline) when given."""
  text = json.dumps(result, indent=indent)
  if path:
    with open(path, 'w') as f:
      f.write(text + '\n')
  return text

def _compilation_line(compilation: Mapping[str, Any]) -> str:
  cached = (f', {compilation["persistent_cache_hits"]} from the cache in '
            f'{compilation["cache_dir"]}' if compilation['cache_dir'] else '')
  return (f'{compilation["xla_compilations"]} XLA compilations in all, '
          f'{compilation["compile_s"]:.1f} s{cached}')


def cross_kv_explanation(cross: Mapping[str, Any]) -> str:
  """One line saying what the cross-attention K/V row measures and how to read it."""
  every_step = next(r for r in cross['rows'] if not r['cache_cross_kv'])
  if every_step['cross_kv_matmuls_in_decoding_loop'] == 0:
    reading = ('XLA hoisted the per-step projections out of the loop itself, so both do '
               'the same work and the FLOP bound does not apply')
  else:
    reading = 'the per-step loop still holds the projections the FLOP bound counts'
  return (f"(the decoder alone, the same for every variant: the encoder's keys/values "
          f"once per sequence, ours, vs at every step, t5x's; {reading})")


def plan_lines(rows: Sequence[Mapping[str, Any]],
               title: str = 'plans (coda_jax.plan: how each encoder runs):') -> List[str]:
  """A line per row with a plan: the variant's name and its plan (the
  row's ``plan['summary']``), under `title`; none for rows without one."""
  plans = [(row['name'], row['plan']['summary']) for row in rows if row.get('plan')]
  if not plans:
    return []
  width = max(len(name) for name, _ in plans)
  return [title] + [
      f'  {name:<{width}}  {summary}' for name, summary in plans]


PAPER_HEAD = '  paper x'


def _by_r(task: Mapping[str, Any]) -> bool:
  """Whether the paper gives `task` a speed-up per r (a column), not one
  speed-up (a speech task's Table 1: a line under the table)."""
  return bool(task.get('paper')) and 'speedup_by_r' in task['paper']


def paper_head(task: Mapping[str, Any]) -> str:
  """The paper column's header ('' for a task without one)."""
  return PAPER_HEAD if _by_r(task) else ''


def paper_cell(task: Mapping[str, Any], row: Mapping[str, Any]) -> str:
  """The paper's measured end-to-end speed-up beside a row ('' for a task
  without a column, '-' for a row the paper has none for)."""
  if not _by_r(task):
    return ''
  x = row.get('paper_speedup')
  return f'{x:9.1f}' if x is not None else f'{"-":>9}'


def paper_note(task: Mapping[str, Any]) -> List[str]:
  """The line saying where the paper column comes from, or quoting the
  paper's one speed-up for the task (none without one)."""
  paper = task.get('paper')
  if not paper:
    return []
  if not _by_r(task):
    return [f'paper: CoDA {paper["speedup"]}x end to end: {paper["source"]}']
  return [f'paper x: {paper["source"]} (end to end, k-to-all)']


def shape_notes(task: Mapping[str, Any]) -> List[str]:
  """The lines a task keeps under 'notes' (a speech task's decoding, a
  shape chosen for a CPU)."""
  return list(task.get('notes') or [])


def ffn_cell(acm: Optional[Mapping[str, Any]]) -> str:
  """An ACM row's 'ffn enc/dec' cell: the FFN work its capacities keep in the
  encoder and in a decoding step ('1/1' for the dense model)."""
  return (f'{acm["encoder_ffn_fraction"]:.2f}/{acm["decoder_ffn_fraction"]:.2f}' if acm
          else '1/1')


def _acm_lines(task: Mapping[str, Any]) -> list:
  """The ACM block of a task: the dense model and each budget, speed-ups over dense."""
  acm = task['acm']
  head = (f'{"variant":22s} {"ffn enc/dec":>11s} {"enc ms":>9s} {"dec ms":>9s} '
          f'{"e2e ms":>9s} {"enc x (bound)":>15s} {"dec x (bound)":>15s} '
          f'{"e2e x (bound)":>15s} {"e2e/bnd":>7s} {"comp s":>7s}')
  lines = table_lines(f'ACM ({task["task"]}): speed-ups over {acm["baseline"]}; each model '
                      "its own encoder and decoder; 'auto' inference (gather or masked, as the "
                      'plans below say), capacities from a recorded learner usage', head)
  for row in acm['variants']:
    med, sp, bd = row['median_ms'], row['speedup'], row['flop_bound']
    lines.append(
        f'{row["name"]:22s} {ffn_cell(row["acm"]):>11s} {med["encoder"]:9.1f} '
        f'{med["decoder"]:9.1f} '
        f'{med["end_to_end"]:9.1f} {sp["encoder"]:6.2f} ({bd["encoder"]:5.2f}) '
        f'{sp["decoder"]:6.2f} ({bd["decoder"]:5.2f}) '
        f'{sp["end_to_end"]:6.2f} ({bd["end_to_end"]:5.2f}) '
        f'{row["fraction_of_bound"]["end_to_end"]:7.2f} '
        f'{row["compile_s"]["end_to_end"]:7.1f}')
  lines += [f'  {row["name"]}: {row["acm"]["capacities_from"]}' for row in acm['variants']
            if row['acm']]
  decoders = [{'name': row['name'], 'plan': row.get('decoder_plan')}
              for row in acm['variants']]
  return (lines + plan_lines(acm['variants'])
          + plan_lines(decoders, 'plans of a decoding step (coda_jax.plan):'))


def format_table(result: Mapping[str, Any]) -> str:
  """The human-readable table of a result."""
  meta = result['meta']
  lines = [f'model {meta["model"]}  device {meta["platform"]} ({meta["device_kind"]})  '
           f'dtype {meta["dtype"]}  decoding {meta["decoding"]}'
           + (f' x{meta["num_beams"]} beams' if meta['num_beams'] > 1 else '')
           + f'  repeats {meta["repeats"]}  jax {meta["jax_version"]}']
  head = (f'{"variant":22s} {"k":>5s} {"enc ms":>9s} {"dec ms":>9s} {"e2e ms":>9s} '
          f'{"enc x (bound)":>15s} {"e2e x (bound)":>15s} {"enc/bnd":>7s} '
          f'{"topk %":>6s} {"e2e x min":>9s} {"enc comp s":>10s}')
  for task in result['tasks']:
    speech = task.get('speech')
    shape = (f'input {speech["input_frames"]} frames ({speech["encoder_frames"]} encoder '
             f'frames), {speech["symbols_per_frame"]} label steps a frame' if speech else
             f'input {task["input_length"]}, output {task["output_length"]}')
    lines += table_lines(
        f'{task["task"]}: {shape}, '
        f'batch {task["batch_size"]} (speed-ups over {task["baseline"]}; one decoder for '
        f'all, compiled in {task["decoder"]["compile_s"]:.1f} s; '
        f'{task["xla_compilations"]["compile"]} XLA compilations)',
        head + paper_head(task))
    for row in task['variants']:
      med, sp, bd = row['median_ms'], row['speedup'], row['flop_bound']
      topk = row['soft_topk']
      topk_text = f'{100 * topk["share_of_end_to_end"]:6.2f}' if topk else f'{"-":>6s}'
      lines.append(
          f'{row["name"]:22s} {row["k"]:5d} {med["encoder"]:9.1f} {med["decoder"]:9.1f} '
          f'{med["end_to_end"]:9.1f} {sp["encoder"]:6.2f} ({bd["encoder"]:5.2f}) '
          f'{sp["end_to_end"]:6.2f} ({bd["end_to_end"]:5.2f}) '
          f'{row["fraction_of_bound"]["encoder"]:7.2f} {topk_text} '
          f'{row["speedup_of_min"]["end_to_end"]:9.2f} '
          f'{row["compile_s"]["encoder"]:10.1f}' + paper_cell(task, row))
    lines += paper_note(task) + shape_notes(task) + plan_lines(task['variants'])
    if task.get('acm'):
      lines += _acm_lines(task)
  cross = result.get('cross_kv')
  if cross:
    lines.append('')
    lines.append(f'cross-attention K/V ({cross["task"]}: input {cross["input_length"]}, '
                 f'output {cross["output_length"]}, batch {cross["batch_size"]}, '
                 f'{cross["model"]}, decoder time)')
    for row in cross['rows']:
      lines.append(f'  {row["cross_kv"]:18s} {row["median_ms"]:10.1f} ms   cross K/V '
                   f'matmuls left in the decoding loop: '
                   f'{row["cross_kv_matmuls_in_decoding_loop"]}')
    lines.append(f'  once-per-sequence speed-up {cross["speedup_once_over_every_step"]:.2f}x '
                 f'(FLOP bound {cross["flop_bound"]:.2f}x)')
    lines.append('  ' + cross_kv_explanation(cross))
  if meta.get('compilation'):
    lines += ['', _compilation_line(meta['compilation'])]
  if result.get('checks'):
    lines.append('')
    for c in result['checks']:
      lines.append(f'  [{"ok" if c["ok"] else "MISS"}] {c["check"]}: {c["value"]:.3f}')
  return '\n'.join(lines)


def plot(result: Mapping[str, Any], path: str) -> str:
  """Figure 7a: end-to-end speed-up vs r per attention variant, FLOP bounds dashed."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  tasks = result['tasks']
  fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.8), squeeze=False)
  colors = {'k_to_all': 'tab:blue', 'k_to_k': 'tab:orange'}
  for ax, task in zip(axes[0], tasks):
    for att in result['meta']['attention']:
      rows = sorted((r for r in task['variants'] if r['attention'] == att),
                    key=lambda r: r['reduction_factor'])
      rs = [r['reduction_factor'] for r in rows]
      color = colors.get(att)
      ax.plot(rs, [r['speedup']['end_to_end'] for r in rows], 'o-', color=color,
              label=f'CoDA {att.replace("_", "-")}')
      ax.plot(rs, [r['flop_bound']['end_to_end'] for r in rows], '--', color=color,
              alpha=0.7, label=f'FLOP bound {att.replace("_", "-")}')
    ax.axhline(1.0, color='gray', lw=0.8, ls=':')
    ax.set_xlabel('reduction factor r')
    ax.set_ylabel('decoding speed-up over Parallel Adapter')
    ax.set_title(f'{task["task"]} (n={task["input_length"]}, '
                 f'out={task["output_length"]}, B={task["batch_size"]})', fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  meta = result['meta']
  fig.suptitle(f'{meta["model"]} on {meta["platform"]}, {meta["dtype"]}, '
               f'{meta["decoding"]}', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
