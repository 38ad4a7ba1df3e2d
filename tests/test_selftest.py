"""coda-jax selftest: each kernel against its XLA formulation (interpret mode
on this CPU), a broken kernel named with exit 1, and a run that falls back
to XLA for it and trains on."""
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax.measure import selftest
from coda_jax.config import CodaConfig, T5Config
from coda_jax.kernels import mlp as mlp_kernel
from coda_jax.model.network import Transformer
from coda_jax.plan import KERNELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'gin_configs', 'runs', 'quickstart.gin')


def _broken_mlp(monkeypatch):
  """The MLP kernel returning its output times 1.01 (a one-percent bug)."""
  call = mlp_kernel._kernel_call  # pylint: disable=protected-access
  monkeypatch.setattr(mlp_kernel, '_kernel_call',
                      lambda *args: (call(*args) * 1.01).astype(args[0].dtype))


@pytest.mark.parametrize('dtype,edges', [('float32', True), ('bfloat16', False)])
def test_every_kernel_matches_xla_at_the_run_shapes_and_the_edges(tmp_path, dtype, edges):
  """On a CPU the plan selects no kernel: the command checks every one, in
  interpret mode, forward and gradients (the decoding step's cross-attention:
  forward), at the run's shapes and (float32) the edges: k of 77 and 171,
  all distances to 255, multi-query heads, padding, keys in blocks."""
  out = tmp_path / 'selftest.json'
  # The soft top-k (float32 only: it computes in float32) once, in the
  # second run; tests/test_kernels_soft_topk.py holds it to XLA at more shapes.
  code = selftest.main(['--model', 'tiny', '--length', '64', '--reduction_factors', '3',
                        '--attentions', 'k_to_k', '--batch_size', '1', '--dtypes', dtype,
                        '--out', str(out)] + ([] if edges else ['--no_edges']) + (
                            ['--kernels',
                             'attention,mlp,route,output,decode_attention,beam_attention,'
                             'lm_head,fused_attention']
                            if edges else []))
  assert code == 0
  report = json.loads(out.read_text())
  assert report['off'] == [] and report['platform'] == 'cpu'
  results = report['results']
  assert {r['kernel'] for r in results} == {'attention', 'mlp', 'route', 'output',
                                            'decode_attention', 'beam_attention',
                                            'lm_head', 'fused_attention'} | (
      set() if edges else {'soft_topk'})
  labels = {(r['kernel'], r['case']) for r in results}
  assert ('attention', 'k_to_k k = 22 of 64') in labels and ('mlp', '22 rows') in labels
  if edges:
    # k = 77 on three sequences: a v4 splits the batch axis unevenly over
    # its two TensorCores.
    assert {('attention', 'k_to_k k = 77, 3 sequences'), ('attention', 'k_to_k k = 171'),
            ('attention', 'multi-query heads'), ('attention', 'distances 0-255, bias-dominated'),
            ('route', 'k = 171 of 172'), ('output', 'k = 77 of 172, 3 sequences'),
            ('mlp', '77 rows, 3 sequences'),
            ('decode_attention', 'one step over n = 77, 3 sequences'),
            ('decode_attention', 'one step over n = 64, multi-query heads'),
            ('decode_attention', 'one step over n = 300, key blocks'),
            ('beam_attention', '4 beams over 64 cached positions'),
            ('beam_attention', '4 beams over 128 cached positions'),
            ('beam_attention', '4 beams over 64 cached positions, a bias per row, '
             '3 sequences'),
            ('lm_head', "4 beams' top 8 of the vocabulary"),
            ('lm_head', "4 beams' top 8 of 700 tokens in blocks of 128, 3 sequences"),
            ('fused_attention', 'k_to_k k = 77, 3 sequences'),
            ('fused_attention', 'multi-query heads'),
            ('fused_attention', 'distances 0-255, bias-dominated')} <= labels
    assert all(r['shape']['batch'] == 3 for r in results if '3 sequences' in r['case'])
  skipped = {(r['kernel'], r['case']) for r in results if r['skipped'] is not None}
  # XLA on a CPU cannot differentiate the route kernel's bfloat16 reference
  # (a bfloat16 dot into float32); the tiny MLP has no non-resident split.
  assert skipped <= {('mlp', '64 rows, non-resident weights'),
                     ('mlp', "a decoding step's 64 rows in one block, x and y "
                             'single-buffered')} | (
      {l for l in labels if l[0] == 'route'} if dtype == 'bfloat16' else set()), skipped
  for r in results:
    assert r['error'] is None, r
    if r['skipped'] is None:
      assert r['forward_error'] <= r['tolerance']['forward'], r
      if r['kernel'] in ('decode_attention', 'beam_attention', 'lm_head'):   # forward only
        assert r['gradient_error'] is None, r
      else:
        assert r['gradient_error'] <= r['tolerance']['gradient'], r
      assert r['kernel_ms'] is None            # no timing off an accelerator


def test_the_mlp_kernel_with_its_weights_in_blocks_matches_xla():
  """The non-resident MLP (weights re-read per block of rows, what large
  models run on a v4) at a shape that has one."""
  config = T5Config(emb_dim=256, num_heads=2, head_dim=32, mlp_dim=2048, vocab_size=64)
  [case] = [c for c in selftest.cases(['mlp'], config, CodaConfig(), 128, [128], ['float32'],
                                      batch=2) if 'non-resident' in c.label]
  result = selftest.run_case(case, interpret=True, timing=True)
  assert result.error is None and result.skipped is None and result.ok, result.as_dict()
  # On an accelerator the table has each kernel's time beside XLA's.
  assert result.kernel_ms > 0 and result.xla_ms > 0
  assert 'kernel ms' in selftest.table([result], timing=True)


def test_the_mlp_kernel_on_a_decoding_steps_rows_in_one_block_matches_xla():
  """A decoding step's rows as one block of tokens, x and y single-buffered
  while the hidden units go in blocks (the weights read once: a §6 XL beam
  search step on a v4), at a shape that has one."""
  from coda_jax.kernels import mlp as mlp_kernel  # pylint: disable=g-import-not-at-top
  config = T5Config(emb_dim=256, num_heads=2, head_dim=32, mlp_dim=2048, vocab_size=64)
  [case] = [c for c in selftest.cases(['mlp'], config, CodaConfig(), 128, [128], ['float32'],
                                      batch=2) if 'single-buffered' in c.label]
  assert case.shape['batch'] == 1
  result = selftest.run_case(case, interpret=True)
  assert result.error is None and result.skipped is None and result.ok, result.as_dict()
  # The plan of the §6 XL beam step's MLP on a v4 is this one.
  plan = mlp_kernel.plan(1, 512, 2048, 8192, 2, 2, 16 * 2 ** 20, single_block=True)
  assert plan.fits and plan.single_buffered and plan.hidden_block == 128


def test_a_bucket_shift_at_a_boundary_is_caught(monkeypatch):
  """The distances case sees one bucket off: T5's bucket of distance 32
  moved to its neighbour (what one ulp of `log` does) in the kernel only."""
  from coda_jax.kernels import relpos_attention  # pylint: disable=g-import-not-at-top
  real = relpos_attention.relative_position_bucket

  def shifted(relative, bidirectional=True, num_buckets=32, max_distance=128):
    buckets = real(relative, bidirectional, num_buckets, max_distance)
    return jnp.where(jnp.abs(relative) == 32, buckets - 1, buckets)

  monkeypatch.setattr(relpos_attention, 'relative_position_bucket', shifted)
  config = T5Config(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, vocab_size=64)
  [case] = [c for c in selftest.cases(['attention'], config, None, 64, [64], ['float32'])
            if c.label.startswith('distances')]
  result = selftest.run_case(case, interpret=True)
  assert not result.ok and result.forward > 1e-3, result.as_dict()


# Each kernel's entry point (module in coda_jax.kernels, function), which
# kernel_checks' builders call.
ENTRY_POINTS = {'attention': ('relpos_attention', 'relpos_attention'), 'mlp': ('mlp', 'mlp'),
                'route': ('route_adapter', 'route_adapter'),
                'output': ('unroute_combine', 'unroute_combine'),
                'soft_topk': ('soft_topk', 'soft_topk_iterative'),
                'decode_attention': ('decode_attention', 'decode_attention'),
                'beam_attention': ('slot_attention', 'slot_attention'),
                'lm_head': ('top_logits', 'top_logits'),
                'fused_attention': ('fused_attention', 'fused_attention')}


def _tiny_cases(kernel, dtype, edges):
  """The kernel's cases at the tiny preset's shapes, k_to_k, k = 22 of 64."""
  from coda_jax.measure import models  # pylint: disable=g-import-not-at-top
  return selftest.cases([kernel], models.make_config('tiny', 'float32'),
                        CodaConfig(attention='k_to_k'), 64, [22], [dtype], batch=2,
                        edges=edges)


def _patch(monkeypatch, kernel, make):
  """The kernel's entry point replaced by `make(the real one)`."""
  module, name = ENTRY_POINTS[kernel]
  module = importlib.import_module(f'coda_jax.kernels.{module}')
  monkeypatch.setattr(module, name, make(getattr(module, name)))
  return module


def test_every_kernel_has_an_entry_point_to_break():
  assert set(ENTRY_POINTS) == set(KERNELS)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
@pytest.mark.parametrize('kernel', KERNELS)
def test_a_kernel_one_and_a_half_percent_off_is_off(monkeypatch, kernel, dtype):
  """Every kernel's outputs times 1.015 (and so its gradients): in float32
  150 x the tolerance; in bfloat16, where XLA's own RMS error from the
  float32 reference is 0.2-0.7%, past 1.25 x that + 2^-8."""
  if kernel == 'soft_topk' and dtype == 'bfloat16':
    pytest.skip('the soft top-k computes in float32: it has no bfloat16 case')

  def wrong(real):
    def call(*args, **kwargs):
      return jax.tree.map(lambda o: (o * 1.015).astype(o.dtype)
                          if jnp.issubdtype(o.dtype, jnp.floating) else o, real(*args, **kwargs))
    return call
  _patch(monkeypatch, kernel, wrong)
  result = selftest.run_case(_tiny_cases(kernel, dtype, edges=False)[0], interpret=True)
  if result.skipped is not None:      # a CPU whose XLA has no bfloat16 x bfloat16 -> float32 dot
    assert dtype == 'bfloat16' and 'UNIMPLEMENTED' in result.skipped, result.as_dict()
    pytest.skip(result.skipped)
  assert result.error is None and not result.ok, result.as_dict()
  assert result.forward > result.bound('forward'), result.as_dict()


def _decode_in_batch_major_form(real):
  """XLA's formulation of the decoding step's attention in its other form
  (the batch axes leading: the same products, another order)."""
  from coda_jax.kernels.relpos import MASK_VALUE  # pylint: disable=g-import-not-at-top
  from coda_jax.model.attention.dot_product import dot_product_attention  # pylint: disable=g-import-not-at-top
  del real

  def call(query, key, value, real, *, key_block=None, interpret):
    del key_block, interpret
    bias = jnp.where(real, 0., MASK_VALUE).astype(query.dtype)[:, None, None, :]
    return dot_product_attention(query[:, None], key, value, bias=bias, deterministic=True,
                                 dtype=query.dtype, kv_layout='heads_major',
                                 form='batch_major')[:, 0]
  return call


def _mlp_in_two_halves(real):
  """The MLP's output as two halves of its hidden units, each a float32 sum,
  added and rounded once: the kernel's non-resident order, in XLA."""
  del real

  def call(x, norm_scale, wi, wo, activations, *, interpret, **unused):
    del interpret, unused
    hidden = mlp_kernel._hidden(mlp_kernel._norm(x, norm_scale, 1e-6), wi, activations)  # pylint: disable=protected-access
    half = wo.shape[0] // 2
    dot = lambda h, w: jax.lax.dot_general(h, w, (((h.ndim - 1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32)
    return (dot(hidden[..., :half], wo[:half]) + dot(hidden[..., half:], wo[half:])
            ).astype(x.dtype)
  return call


def _beam_by_gather(real):
  """Beam attention as `slot_attention.reference` (the cache gathered, then
  one float32 sum per beam), compiled by XLA."""
  from coda_jax.kernels import slot_attention  # pylint: disable=g-import-not-at-top
  del real
  return lambda q, k, v, slots, bias, *, interpret: slot_attention.reference(q, k, v, slots, bias)


@pytest.mark.parametrize('kernel,make', [('decode_attention', _decode_in_batch_major_form),
                                         ('mlp', _mlp_in_two_halves),
                                         ('beam_attention', _beam_by_gather)])
def test_a_kernel_as_good_as_xla_in_bfloat16_passes(monkeypatch, kernel, make):
  """A "kernel" that is XLA's formulation in another order, compiled (XLA:CPU
  keeps some bfloat16 intermediates in float32 where it fuses): each of its
  bfloat16 cases, edges too, is ok."""
  _patch(monkeypatch, kernel, make)
  results = [selftest.run_case(case, interpret=True)
             for case in _tiny_cases(kernel, 'bfloat16', edges=True)]
  checked = [r for r in results if r.skipped is None]     # the tiny MLP has no blocks
  assert len(checked) >= 3 and all(r.ok for r in checked), [r.as_dict() for r in results]
  assert all(0 < r.xla_forward and r.forward <= r.bound('forward') for r in checked)


def test_the_beam_kernel_on_a_bias_per_row_passes_in_bfloat16():
  """The case `coda-jax selftest` called off when it compared two bfloat16
  results with each other (3.5e-2 against 3e-2): the kernel rounds where
  XLA's formulation does, exactly as far from the float32 reference. Its row
  shows both errors and the bound."""
  from coda_jax.measure import models  # pylint: disable=g-import-not-at-top
  from coda_jax.training import preflight  # pylint: disable=g-import-not-at-top
  [case] = [c for c in selftest.cases(['beam_attention'], models.make_config('base', 'float32'),
                                      CodaConfig(), 384, [128], ['bfloat16'])
            if c.label == '4 beams over 64 cached positions, a bias per row, 3 sequences']
  result = selftest.run_case(case, interpret=True)
  assert result.ok and result.error is None and result.skipped is None, result.as_dict()
  assert result.forward <= 1.01 * result.xla_forward, result.as_dict()
  report = result.as_dict()
  assert report['tolerance']['forward'] == result.bound('forward') > result.forward
  assert report['xla_forward_error'] == result.xla_forward and report['against'] == 'reference'
  [row] = selftest.table([result], timing=False).splitlines()[1:]
  assert f'{result.forward:9.2e}' in row and f'{result.xla_forward:9.2e}' in row
  assert f'{result.bound("forward"):.2e} / -' in row and row.rstrip().endswith('ok')
  assert "1.25 x XLA's" in preflight._how_far(result)  # pylint: disable=protected-access


def test_a_broken_kernel_is_named_and_exits_1(monkeypatch, capsys):
  _broken_mlp(monkeypatch)
  code = selftest.main(['--model', 'tiny', '--length', '32', '--kernels', 'mlp,route',
                        '--dtypes', 'float32', '--no_edges', '--batch_size', '1'])
  assert code == 1
  captured = capsys.readouterr()
  assert "OFF: mlp (use XLA for it: T5Config.mlp_kernel='xla')" in captured.err
  rows = [line for line in captured.out.splitlines() if line.startswith('mlp ')]
  assert rows and all('OFF' in line for line in rows)
  assert any(line.startswith('route ') and ' ok ' in line for line in captured.out.splitlines())


@pytest.mark.parametrize('interpret', [True, False])
def test_a_host_that_cannot_run_interpret_mode_skips_instead_of_failing(monkeypatch, interpret):
  """Some CPUs' XLA has no bfloat16 x bfloat16 -> float32 dot, which a
  kernel's interpret-mode program may contain: that case is skipped, with
  the reason, not called off. On the chip (no interpret mode) the same error
  is the kernel's."""
  from coda_jax.training import kernel_checks, kernel_operands  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  def unrunnable(x):
    raise jax.errors.JaxRuntimeError(  # what the CPU runtime raised in CI
        'UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32')

  def builder(case, interpret):
    return unrunnable, lambda x: 2 * x, (jnp.ones((4, 4), jnp.float32),)
  monkeypatch.setitem(kernel_operands.BUILDERS, 'mlp', builder)
  case = kernel_checks.Case('mlp', '4 rows', 'bfloat16', ())
  result = kernel_checks.run_case(case, interpret=interpret)
  if interpret:
    assert result.skipped is not None and 'DotThunk' in result.skipped and result.error is None
  else:
    assert result.skipped is None and 'DotThunk' in result.error and not result.ok


def test_check_run_switches_an_off_kernel_to_xla_and_caches_verdicts(monkeypatch, tmp_path):
  monkeypatch.setenv('CODA_JAX_CACHE_DIR', str(tmp_path))
  model = Transformer(T5Config(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                               vocab_size=64, mlp_kernel='pallas', attention_kernel='pallas'),
                      coda=CodaConfig(reduction_factor=4))
  lines = []
  assert selftest.check_run(model, 32, [8], dtype='float32', mode='auto',
                            log=lines.append) is model          # a CPU: not checked
  assert selftest.check_run(model, 32, [8], dtype='float32', mode='always',
                            log=lines.append) == model and not lines
  cache = json.loads((tmp_path / 'selftest.json').read_text())
  [verdicts] = cache.values()
  assert {v['kernel'] for v in verdicts.values()} == {'attention', 'mlp'}
  _broken_mlp(monkeypatch)
  checked = selftest.check_run(model, 32, [8], dtype='float32', mode='always',
                               log=lines.append)
  # The attention's verdicts were cached ok; the MLP's were too, so it is not
  # checked again until the versions change: a fresh cache sees the bug.
  assert checked == model
  (tmp_path / 'selftest.json').unlink()
  checked = selftest.check_run(model, 32, [8], dtype='float32', mode='always',
                               log=lines.append)
  assert checked.config.mlp_kernel == 'xla' and checked.config.attention_kernel == 'pallas'
  [line] = lines
  assert line.startswith('selftest: the mlp kernel differs from XLA on this cpu (forward')
  assert line.endswith('this run uses XLA for it')
  with pytest.raises(ValueError, match="selftest must be 'auto', 'always' or 'never'"):
    selftest.check_run(model, 32, [8], dtype='float32', mode='sometimes')


def test_the_trainer_falls_back_to_xla_with_one_line_and_trains_on(monkeypatch, tmp_path,
                                                                   capsys):
  """The quickstart run with the MLP kernel asked for and broken: one line
  names it, the run trains with XLA's MLP (its loss is the XLA run's)."""
  from coda_jax.training import command as train_cli  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('CODA_JAX_CACHE_DIR', str(tmp_path / 'cache'))
  _broken_mlp(monkeypatch)

  def train(name, kernel):
    flags = ['--gin_file', QUICKSTART, f'--gin.MODEL_DIR={tmp_path / name!s}',
             '--gin.TRAIN_STEPS=3', '--gin.BATCH_SIZE=4', '--gin.EVAL_PERIOD=None',
             '--gin.CHECKPOINT_PERIOD=3', '--gin.LOG_PERIOD=1',
             '--gin.K_ANNEAL_FRACTION=0.0',     # one k, one compiled step
             '--gin_bindings', f"config.T5Config.mlp_kernel = '{kernel}'",
             '--gin_bindings', "train_lib.train.selftest = 'always'",
             '--gin_bindings', 'train_lib.train.tensorboard = False']
    assert train_cli.main(flags) == 0
    with open(tmp_path / name / 'metrics.jsonl') as f:
      return [json.loads(line) for line in f if '"train"' in line]

  broken = train('pallas', 'pallas')
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('selftest:')]
  assert len(lines) == 1 and 'the mlp kernel differs from XLA' in lines[0], lines
  xla = train('xla', 'xla')
  assert len(broken) == len(xla) == 3
  np.testing.assert_allclose([r['loss'] for r in broken], [r['loss'] for r in xla],
                             rtol=1e-6)


def test_a_runs_gin_files_give_its_model_and_shapes(tmp_path, capsys):
  """`--gin_file`: the run's own model and input length (the quickstart: 48
  tokens, r = 2, so k = 24), as the trainer would build them."""
  code = selftest.main(['--gin_file', QUICKSTART, f'--gin.MODEL_DIR={tmp_path}',
                        '--kernels', 'mlp', '--dtypes', 'float32', '--no_edges',
                        '--batch_size', '1', '--out', str(tmp_path / 'out.json')])
  assert code == 0
  report = json.loads((tmp_path / 'out.json').read_text())
  assert [r['case'] for r in report['results']] == ['48 rows', '24 rows']
  assert all(r['shape']['emb'] == 32 and r['shape']['mlp_dim'] == 64
             for r in report['results'])


@pytest.mark.parametrize('argv,n,ks', [
    (['--model', 'whisper_tiny', '--length', '3000', '--reduction_factors', '2,4'],
     1500, [750, 375]),                                 # Whisper: ceil(frames / 2)
    (['--model', 'speech_base', '--length', '3200'], 800, [267, 160]),  # the 4x stem
    (['--model', 'base', '--length', '384'], 384, [128, 77])])
def test_a_speech_models_length_is_its_frames(argv, n, ks):
  """`--length` is the inputs' length: a speech model's kernels run at its
  encoder's positions, the frames its stem leaves."""
  runs = selftest._runs(selftest._parse(argv + ['--attentions', 'k_to_all']))
  assert [(run[3], run[4]) for run in runs] == [(n, ks)]
