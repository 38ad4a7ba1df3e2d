"""coda_jax.plan: every choice of a program resolved once, from rows with evidence."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

from coda_jax import plan as plan_lib
from coda_jax.plan import target
from coda_jax.plan import chips
from coda_jax.config import (AcmConfig, CodaConfig, SoftTopKConfig, parallel_adapter_baseline,
                             preset, t5_1_1)
from coda_jax.model.network import Transformer
from coda_jax.plan.target import Target

from tiny_models import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = t5_1_1('base', dtype=jnp.bfloat16)
KIND = {name: chip.device_kind for name, chip in chips.CHIPS.items()}
N = 384


def _tpu(chip: str) -> Target:
  return Target('tpu', KIND[chip])


def _choices(plan):
  """(attention, mlp, dispatch, route, output) of the routed layers, or
  (attention, mlp) of the dense ones."""
  if plan.routed is None:
    return (plan.dense.attention, plan.dense.mlp)
  r = plan.routed
  return (r.attention, r.mlp, r.dispatch, r.route, r.output)


# chip x variant x k / n -> what 'auto' runs (base, n = 384, batch-free).
# r = 5: k = 77 (0.20); r = 3: k = 128 (0.33); r = 1.5: k = 256 (0.67).
TABLE = [
    # (target, attention variant (None: Parallel Adapter), r, expected)
    ('v4', None, None, ('pallas', 'pallas')),
    ('v4', 'k_to_all', 5, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    ('v4', 'k_to_k', 5, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    ('v4', 'k_to_all', 3, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    ('v4', 'k_to_k', 3, ('pallas', 'pallas', 'one_hot', 'xla', 'xla')),
    ('v5e', None, None, ('pallas', 'pallas')),
    ('v5e', 'k_to_all', 5, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    ('v5e', 'k_to_k', 5, ('pallas', 'pallas', 'one_hot', 'xla', 'pallas')),
    ('v5e', 'k_to_all', 3, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    ('v5e', 'k_to_k', 3, ('pallas', 'pallas', 'one_hot', 'pallas', 'xla')),
    # Above the k / n measured (0.34), no route or output row applies.
    ('v5e', 'k_to_k', 1.5, ('pallas', 'pallas', 'one_hot', 'xla', 'xla')),
    ('v4', 'k_to_all', 2, ('pallas', 'pallas', 'one_hot', 'xla', 'xla')),
    ('v5p', None, None, ('pallas', 'pallas')),
    ('v5p', 'k_to_all', 5, ('pallas', 'pallas', 'one_hot', 'xla', 'pallas')),
    ('v5p', 'k_to_k', 3, ('pallas', 'pallas', 'one_hot', 'xla', 'pallas')),
    ('v6e', None, None, ('pallas', 'pallas')),
    ('v6e', 'k_to_all', 5, ('pallas', 'pallas', 'one_hot', 'xla', 'pallas')),
    ('v6e', 'k_to_k', 3, ('pallas', 'pallas', 'one_hot', 'xla', 'pallas')),
    # Chips with no row: XLA's fusions, gathers.
    ('unknown tpu', 'k_to_all', 3, ('xla', 'xla', 'gather', 'xla', 'xla')),
    ('cpu', 'k_to_k', 5, ('xla', 'xla', 'gather', 'xla', 'xla')),
    ('gpu', None, None, ('xla', 'xla')),
]


def _target(name: str) -> Target:
  if name in KIND:
    return _tpu(name)
  return {'unknown tpu': Target('tpu', 'TPU v7x'), 'cpu': Target('cpu', 'cpu'),
          'gpu': Target('gpu', 'NVIDIA H100 80GB HBM3')}[name]


@pytest.mark.parametrize('chip,attention,r,expected', TABLE)
def test_chip_variant_and_k_give_the_plan(chip, attention, r, expected):
  coda = (parallel_adapter_baseline(CodaConfig()) if attention is None
          else CodaConfig(reduction_factor=r, attention=attention))
  plan = plan_lib.resolve(BASE, coda, target=_target(chip), length=N)
  assert _choices(plan) == expected, plan.describe()
  layer = plan.routed or plan.dense
  assert layer.interpret == (not chip in KIND and chip != 'unknown tpu')
  assert layer.soft_topk == 'xla'                  # no chip has a soft top-k row
  if attention is not None:
    assert plan.k == -(-N // r) and plan.attention_variant == attention
    assert plan.dense is None                       # every layer routes
  if chip == 'unknown tpu':
    assert 'has no measured rule (default)' in plan.describe()
  if chip in ('gpu', 'cpu'):
    assert f'no rule for {chip} (default)' in plan.describe()


@pytest.mark.parametrize('attention,r,n,dispatch', [
    ('k_to_all', 3, 384, 'one_hot'), ('k_to_all', 3, 385, 'gather'),
    ('k_to_all', 5, 1664, 'gather'), ('k_to_k', 3, 384, 'one_hot'), ('k_to_k', 3, 768, 'gather'),
    ('k_to_k', 5, 768, 'one_hot'), ('k_to_k', 3, 1664, 'one_hot')])
def test_rules_hold_for_a_range_of_input_lengths(attention, r, n, dispatch):
  """v4's dispatch depends on n (and for k-to-k on k / n): a one-hot
  dispatch's flops grow with k x n, and a long input's encoder is bound by
  its flops (measured at n = 768 and 1664); the reason names the range."""
  plan = plan_lib.resolve(BASE, CodaConfig(reduction_factor=r, attention=attention),
                          target=_tpu('v4'), length=n)
  assert plan.routed.dispatch == dispatch, plan.describe()
  why = dict(plan.reasons)['dispatch']
  assert ('n > 384' in why) == (dispatch == 'gather'), why
  assert ('n <= 768' in why) == (dispatch == 'gather' and attention == 'k_to_k'), why
  # The route kernel needs the one-hot dispatch (k-to-k: up to k / n = 0.3).
  kernel = dispatch == 'one_hot' and (attention == 'k_to_all' or plan.k / n <= 0.3)
  assert plan.routed.route == ('pallas' if kernel else 'xla'), plan.describe()


@pytest.mark.parametrize('chip,model,n,batch,expected', [
    ('v4', 'base', 1664, 128, 'pallas'), ('v5e', 'text_xl', 384, 128, 'pallas'),
    ('v5p', 'text_base', 512, 128, 'pallas'), ('v6e', 'base', 1664, 128, 'pallas'),
    ('unknown tpu', 'base', 384, 128, 'xla'), ('cpu', 'base', 384, 8, 'xla'),
    ('gpu', 'text_xl', 1664, 128, 'xla')])
def test_the_decoder_plan_from_chip_and_shapes(chip, model, n, batch, expected):
  config = preset(model, dtype=jnp.bfloat16)
  plan = plan_lib.resolve_decoder(config, target=_target(chip), length=n, batch=batch)
  assert plan.cross_attention == expected, plan.describe()
  assert ('decode_attention' in plan.kernels()) == (expected == 'pallas')
  assert plan.interpret == (chip not in KIND and chip != 'unknown tpu')
  assert json.loads(json.dumps(plan.as_dict()))['cross_attention'] == expected
  # Forced: obeyed where the kernel serves; float32 logits it does not.
  forced = dataclasses.replace(config, decode_attention_kernel='pallas')
  assert plan_lib.resolve_decoder(forced, target=_target(chip), length=n,
                                  batch=batch).cross_attention == 'pallas'
  blocked = dataclasses.replace(forced, float32_attention_logits=True)
  plan = plan_lib.resolve_decoder(blocked, target=_target(chip), length=n, batch=batch)
  assert plan.cross_attention == 'xla' and 'float32 attention logits' in plan.describe()


@pytest.mark.parametrize('chip,model,length,expected', [
    ('v4', 'text_xl', 64, 'pallas'), ('v5e', 'text_base', 8, 'pallas'),
    ('v6e', 'text_xl', 512, 'pallas'), ('v4', 'base', 64, 'xla'),
    ('v4', 'text_xl', None, 'xla'), ('v4', 'text_xl', 8192, 'xla'),
    ('cpu', 'text_xl', 64, 'xla'), ('gpu', 'text_base', 64, 'xla')])
def test_beam_search_self_attention_in_the_decoder_plan(chip, model, length, expected):
  """Beam search's self-attention: the kernel on the TPU chips (heads of 128
  lanes, a cache that fits VMEM, a known length), with the reason when not;
  no choice for one row per example; forcing it is obeyed where it serves."""
  config = preset(model, dtype=jnp.bfloat16)
  resolve = lambda cfg, beams: plan_lib.resolve_decoder(
      cfg, target=_target(chip), length=384, batch=128, beams=beams, cache_length=length)
  plan = resolve(config, 4)
  assert plan.beam_attention == expected, plan.describe()
  assert ('beam_attention' in plan.kernels()) == (expected == 'pallas')
  assert 'beam_attention' in dict(plan.reasons) and 'beam attention' in plan.summary()
  assert resolve(config, 1).beam_attention is None
  why = dict(plan.reasons)['beam_attention']
  if model == 'base':
    assert 'head_dim 64' in why, why
  if length is None:
    assert 'cache length is unknown' in why, why
  if length == 8192:
    assert 'do not fit' in why, why
  forced = resolve(dataclasses.replace(config, beam_attention_kernel='pallas'), 4)
  assert forced.beam_attention == ('xla' if model == 'base' or length in (None, 8192)
                                   else 'pallas'), forced.describe()
  blocked = resolve(dataclasses.replace(config, beam_attention_kernel='pallas',
                                        float32_attention_logits=True), 4)
  assert blocked.beam_attention == 'xla' and 'float32 attention logits' in blocked.describe()


@pytest.mark.parametrize('chip,model,beams,expected', [
    ('v4', 'text_xl', 4, 'pallas'), ('v4', 'base', 1, 'pallas'), ('v5e', 'text_xl', 1, 'pallas'),
    ('v6e', 'text_xl', 1, 'pallas'), ('v6e', 'text_xl', 4, 'xla'), ('cpu', 'text_xl', 4, 'xla'),
    ('gpu', 'base', 1, 'xla')])
def test_a_decoding_steps_mlp_in_the_decoder_plan(chip, model, beams, expected):
  """The MLP kernel on a decoding step's rows where the chip's rows say (the
  weights read once for all of them), with the encoder's blockers: LoRA, an
  ACM MLP, units split over devices; 'xla' is obeyed."""
  config = preset(model, dtype=jnp.bfloat16)
  resolve = lambda cfg, **kw: plan_lib.resolve_decoder(
      cfg, target=_target(chip), length=1664, batch=128, beams=beams, cache_length=64, **kw)
  plan = resolve(config)
  assert plan.mlp == expected, plan.describe()
  assert ('mlp' in plan.kernels()) == (expected == 'pallas') and 'mlp ' in plan.summary()
  assert json.loads(json.dumps(plan.as_dict()))['mlp'] == expected
  if chip not in KIND:
    return
  assert 'MiB' not in dict(plan.reasons)['decode_mlp']
  if expected == 'xla':                                  # v6e's rows: up to 128 a step
    assert 'no rule for v6e at 512 tokens a call' in dict(plan.reasons)['decode_mlp']
    return
  lora = resolve(config, coda=CodaConfig(adapter='lora'))
  assert lora.mlp == 'xla' and 'LoRA' in dict(lora.reasons)['decode_mlp']
  acm = resolve(config, acm=AcmConfig(num_learners=4))
  assert acm.mlp == 'xla' and 'ACM MLP' in dict(acm.reasons)['decode_mlp']
  split = resolve(config, sharded=frozenset({'mlp'}))
  assert split.mlp == 'xla' and 'mlp split' in dict(split.reasons)['decode_mlp']
  assert resolve(dataclasses.replace(config, mlp_kernel='xla')).mlp == 'xla'


def test_the_factored_norm_goes_with_the_output_kernel_and_an_xla_mlp():
  coda = CodaConfig(reduction_factor=5, attention='k_to_k')
  plan = plan_lib.resolve(BASE, coda, target=_tpu('v5e'), length=N)
  assert plan.routed.output == 'pallas' and not plan.routed.factored_norm
  xla_mlp = dataclasses.replace(BASE, mlp_kernel='xla')
  plan = plan_lib.resolve(xla_mlp, coda, target=_tpu('v5e'), length=N)
  assert plan.routed.output == 'pallas' and plan.routed.factored_norm


def test_a_plain_t5_and_the_parallel_adapter_model_have_dense_layers_only():
  for coda in (None, parallel_adapter_baseline(CodaConfig())):
    plan = plan_lib.resolve(BASE, coda, target=_tpu('v4'), length=N)
    assert plan.routed is None and plan.k == N and plan.kernels() == ('attention', 'mlp')
  # Some layers routed: both kinds, each with its own choices.
  plan = plan_lib.resolve(BASE, CodaConfig(reduction_factor=5, routed_layers=(1, 3)),
                          target=_tpu('v4'), length=N)
  assert plan.dense.k == N and plan.routed.k == 77 and plan.routed.route == 'pallas'


def test_settings_are_obeyed_where_the_formulation_serves():
  """'xla' / 'gather' and 'pallas' / 'one_hot' win over the rules; 'pallas'
  runs in interpret mode off TPU."""
  forced = dataclasses.replace(BASE, attention_kernel='pallas', mlp_kernel='xla')
  coda = CodaConfig(reduction_factor=3, dispatch='one_hot', route_kernel='pallas',
                    unroute_kernel='xla')
  plan = plan_lib.resolve(forced, coda, target=Target('cpu', 'cpu'), length=N)
  assert _choices(plan) == ('pallas', 'xla', 'one_hot', 'pallas', 'xla')
  assert plan.routed.interpret
  assert "T5Config.attention_kernel = 'pallas'" in dict(plan.reasons)['routed attention']
  plan = plan_lib.resolve(dataclasses.replace(BASE, attention_kernel='xla'),
                          CodaConfig(reduction_factor=5, dispatch='gather'),
                          target=_tpu('v4'), length=N)
  # Gathers: the rules' route kernel is for one-hot dispatch ('pallas' forces it).
  assert _choices(plan) == ('xla', 'pallas', 'gather', 'xla', 'xla')


@pytest.mark.parametrize('case,blocked,why', [
    ('lora', ('mlp',), 'LoRA'),
    ('training_with_dropout', ('attention', 'mlp'), 'dropout'),
    ('packed', ('attention',), 'packed inputs'),
    ('model_parallel', ('mlp', 'route'), 'split over devices'),
    ('xl_on_v4', ('mlp',), 'do not fit 16 MiB of VMEM'),
    ('no_parallel_adapter', ('route',), 'no parallel adapter'),
    ('acm', ('mlp',), 'an ACM MLP'),
    ('layer_norm', ('mlp', 'route'), 'a LayerNorm'),
    ('biases', ('mlp',), 'projection biases'),
])
def test_a_kernel_that_cannot_serve_the_layer_is_not_planned(case, blocked, why):
  config, coda, kwargs, chip = BASE, CodaConfig(reduction_factor=5), {}, 'v4'
  acm = None
  if case == 'lora':
    coda = dataclasses.replace(coda, adapter='lora')
  elif case == 'training_with_dropout':
    config, kwargs = dataclasses.replace(config, dropout_rate=0.1), {'training': True}
  elif case == 'packed':
    kwargs = {'packed': True}
  elif case == 'model_parallel':
    kwargs = {'sharded': frozenset({'mlp', 'embed'})}
  elif case == 'xl_on_v4':
    config = t5_1_1('xl', dtype=jnp.bfloat16)
  elif case == 'no_parallel_adapter':
    coda = dataclasses.replace(coda, adapter='sequential_houlsby')
  elif case == 'acm':
    from coda_jax.config import AcmConfig  # pylint: disable=g-import-not-at-top
    acm = AcmConfig()
  elif case == 'layer_norm':        # Whisper's norms; the kernels compute T5's RMS norm
    config = dataclasses.replace(config, norm='layer')
  elif case == 'biases':            # Whisper's projections
    config = dataclasses.replace(config, use_bias=True)
  plan = plan_lib.resolve(config, coda, acm, target=_tpu(chip), length=N, **kwargs)
  for name in blocked:
    assert getattr(plan.routed, name) == 'xla', plan.describe()
    key = name if name in ('route', 'output') else f'routed {name}'
    assert why in dict(plan.reasons)[key], plan.describe()
  # Without the blocker the rules give the kernel.
  plain = plan_lib.resolve(BASE, CodaConfig(reduction_factor=5), target=_tpu(chip), length=N)
  assert all(getattr(plain.routed, name) == 'pallas' for name in blocked)


def test_k_equal_to_n_moves_no_tokens_and_the_route_accumulator_must_fit():
  plan = plan_lib.resolve(BASE, CodaConfig(reduction_factor=1), target=_tpu('v5e'), length=N)
  assert plan.k == N and plan.routed.route == plan.routed.output == 'xla'
  assert 'k = n' in dict(plan.reasons)['route']
  xxl = t5_1_1('xxl', dtype=jnp.bfloat16)
  plan = plan_lib.resolve(xxl, CodaConfig(reduction_factor=3), target=_tpu('v5e'),
                          length=2048)
  assert plan.routed.route == 'xla' and 'accumulator' in dict(plan.reasons)['route']


def test_soft_topk_kernel_needs_the_iterative_solver_from_colt5s_start():
  with pytest.raises(ValueError, match="impl='pallas'.*method 'exact'"):
    plan_lib.resolve(BASE, CodaConfig(soft_topk=SoftTopKConfig(method='exact', impl='pallas')),
                     target=Target('cpu', 'cpu'), length=N)
  plan = plan_lib.resolve(BASE, CodaConfig(soft_topk=SoftTopKConfig(impl='pallas')),
                          target=Target('cpu', 'cpu'), length=N)
  assert plan.routed.soft_topk == 'pallas'
  plan = plan_lib.resolve(BASE, CodaConfig(normalizer='sigmoid',
                                           soft_topk=SoftTopKConfig(impl='pallas')),
                          target=Target('gpu'), length=N)
  assert plan.routed.soft_topk == 'xla'


def test_the_plan_is_printable_and_json():
  plan = plan_lib.resolve(BASE, CodaConfig(reduction_factor=5, attention='k_to_k'),
                          target=_tpu('v5e'), length=N)
  text = plan.describe()
  assert text.startswith('plan for tpu v5e, n = 384, k = 77 (k_to_k):')
  assert 'benchmarks/plan/base_b128_n384_v5e.json' in text
  assert plan.summary() == ('tpu v5e: attention pallas, mlp pallas, dispatch one_hot, '
                            'route xla, output pallas, soft_topk xla')
  data = json.loads(json.dumps(plan.as_dict()))
  assert data['kernels'] == ['attention', 'mlp', 'output'] and data['k'] == 77


def test_the_encoder_resolves_one_plan_per_program_from_its_target():
  """`network.Encoder` reads the target once while it is traced and notes its
  plan; the layers run the plan's choices (here: the TPU kernels, in
  interpret mode, in a program traced for a v5e)."""
  cfg = tiny_config()
  model = Transformer(cfg, coda=CodaConfig(reduction_factor=4, attention='k_to_k'))
  tokens = jnp.ones((2, 16), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens, tokens))
  # A new function per trace: JAX caches a function's trace, and the target
  # is not part of its key (a program is traced for one target).
  encode = lambda: lambda p: model.apply(p, tokens, method=Transformer.encode,
                                         enable_dropout=False)
  with plan_lib.recording() as plans:
    jaxpr = str(jax.make_jaxpr(encode())(params))
  assert [p.target.platform for p in plans] == [jax.default_backend()]
  assert 'pallas_call' not in jaxpr
  with plan_lib.recording() as plans, target.targeting('tpu', KIND['v5e']):
    jaxpr = str(jax.make_jaxpr(encode())(params))
  [plan] = plans
  assert plan.k == 4 and plan.kernels() == ('attention', 'mlp', 'output')
  # Per routed layer: attention, MLP and output kernels.
  assert jaxpr.count('pallas_call') >= 3 * cfg.num_encoder_layers


def test_rules_name_known_chips_and_choices():
  for rule in plan_lib.RULES:
    assert rule.what in plan_lib.CHOICES and rule.chip in list(chips.CHIPS) + ['gpu', 'cpu']
    assert rule.choice in (plan_lib.DEFAULTS[rule.what], plan_lib._ALTERNATIVE[rule.what])
    lo, hi = rule.fractions
    assert 0 <= lo < hi <= 1
    assert os.path.exists(os.path.join(ROOT, rule.evidence)), rule


def _evidence_files():
  return sorted({rule.evidence for rule in plan_lib.RULES})


# Decoding steps whose rooflines differ by less than this are a tie
# (`coda_jax.plan`: the rows give the kernel, which computes fewer flops).
DECODE_TIE = plan_lib.DECODE_TIE


def _decoder_evidence_agrees(evidence):
  """A `tools/decode_plan_evidence.py` file (both formulations measured at
  each point): the decoder's plan today runs the cross-attention
  formulation with the lower roofline, or one within `DECODE_TIE` of it."""
  chip = evidence['chip']
  assert evidence['measure'] == 'traffic_roofline_seconds'
  tool = _tool('decode_plan_evidence')
  measured = evidence.get('choice', 'attention')
  for point in evidence['points']:
    beams = tool.point_beams(evidence, point)
    # The attention files measure the cross-attention (greedy) or beam
    # search's self-attention, the mlp files the MLP, the lm_head files beam
    # search's LM head, the keys files the cross-attention cache's positions.
    choice, kernel = ((measured, measured) if measured in ('mlp', 'lm_head', 'keys') else
                      ('beam_attention', 'beam_attention') if beams > 1 else
                      ('cross_attention', 'decode_attention'))
    config = preset(point["model"], dtype=jnp.bfloat16)
    plan = plan_lib.resolve_decoder(config, target=_tpu(chip), length=point['length'],
                                    batch=evidence['batch_size'], beams=beams,
                                    cache_length=point['decode_steps'])
    seconds = {f: p['traffic_roofline_seconds'] for f, p in point['programs'].items()}
    where = f'{chip} {point["model"]} n {point["length"]} beams {beams}'
    assert seconds[getattr(plan, choice)] <= (1 + DECODE_TIE) * min(seconds.values()), (
        where, seconds)
    programs = point['programs']
    if measured == 'keys':  # each program's cache held the positions it names
      n = point['length']
      assert programs['as_is']['key_length'] == n, where
      assert programs['lane_padded']['key_length'] == -(-n // 128) * 128 > n, where
      continue
    # The program measured as 'pallas' ran the kernel, the other not (their
    # plans say so).
    assert kernel in programs['pallas']['plan']['kernels'], where
    assert kernel not in programs['xla']['plan']['kernels'], where
  return len(evidence['points'])


def _acm_evidence_agrees(evidence):
  """A `tools/acm_plan_evidence.py` file (an FFN ACM timed 'gather' and
  'masked' at each token count and budget): at every point, 'auto' runs the
  faster formulation, or one within `plan.ACM_TIE` of it, on the file's
  chip (the platform, 'cpu' or 'gpu', that the plan's ACM rows name); and
  the file's points cover both choices."""
  where = target.Target(evidence['chip'])
  chosen = set()
  for point in evidence['points']:
    acm = AcmConfig(num_learners=evidence['num_learners'], inference='auto',
                    learner_usage=evidence['usage_profile']['learner_usage'][
                        str(point['budget'])],
                    capacity_factor=evidence['capacity_factor'])
    assert list(acm.capacities(point['tokens'])) == point['capacities'], point
    choice, why = plan_lib.resolve_acm(acm, where, point['tokens'])
    seconds = point['seconds']
    assert seconds[choice] <= (1 + plan_lib.ACM_TIE) * min(seconds.values()), (
        point['tokens'], point['budget'], seconds, why)
    chosen.add(choice)
  assert chosen == {plan_lib.GATHER, plan_lib.MASKED}
  return len(evidence['points'])


def _xla_attention_evidence_agrees(evidence):
  """A `tools/bench_attention.py` file (XLA's attention timed in both
  forms at each shape): at every shape the plan's form on the file's chip is
  the faster, or within `plan.XLA_ATTENTION_TIE` of it (the file's own
  `plan` is what the rows said when it was measured), and both forms
  computed the same attention."""
  form, _ = plan_lib.resolve_xla_attention(target.Target(evidence['chip']))
  for point in evidence['points']:
    median = {f: row['median_ms'] for f, row in point['forms'].items()}
    assert set(median) == {plan_lib.BATCH_MAJOR, plan_lib.EINSUMS}
    assert median[form] <= (1 + plan_lib.XLA_ATTENTION_TIE) * min(median.values()), point
    assert point['max_abs_difference'] < 1e-4, point
  return len(evidence['points'])


def _attention_evidence_files():
  folder = os.path.join(ROOT, 'benchmarks', 'plan', 'attention')
  return sorted(os.path.join('benchmarks', 'plan', 'attention', name)
                for name in os.listdir(folder) if name.endswith('.json'))


def test_every_xla_attention_file_agrees_with_the_rows():
  """Both files of benchmarks/plan/attention/ (the rule cites one), T5
  v1.1-small's heads and the §6 models' multi-query heads."""
  files = _attention_evidence_files()
  assert set(files) >= {e for e in _evidence_files() if '/attention/' in e} and len(files) >= 2
  for path in files:
    with open(os.path.join(ROOT, path)) as f:
      evidence = json.load(f)
    assert evidence['program'] == 'xla_attention', path
    assert _xla_attention_evidence_agrees(evidence) >= 5, path


@pytest.mark.parametrize('path', _evidence_files())
def test_rules_agree_with_their_evidence(path):
  """In each committed measurement (`tools/plan_evidence.py`: a plan and its
  single flips, one choice to the other formulation), the plan the rules
  give today is one of the programs measured, and no other was faster on the
  TPU compiler's cost model (by the file's measure: the compiler's bytes
  accessed, or the roofline at the HBM traffic)."""
  with open(os.path.join(ROOT, path)) as f:
    evidence = json.load(f)
  if evidence.get('program') == 'decode_step':
    assert _decoder_evidence_agrees(evidence) >= 6
    return
  if evidence.get('program') == 'acm_ffn':
    assert evidence['chip'] in ('cpu', 'gpu') and _acm_evidence_agrees(evidence) >= 10
    return
  if evidence.get('program') == 'xla_attention':
    assert _xla_attention_evidence_agrees(evidence) >= 5
    return
  assert not evidence['search']
  measure = evidence.get('measure', 'bytes_accessed')
  chip = evidence['chip']
  config = dataclasses.replace(t5_1_1(evidence['model'], dtype=jnp.bfloat16),
                               num_encoder_layers=evidence['layers'],
                               num_decoder_layers=evidence['layers'])
  checked = 0
  for variant in evidence['variants']:
    coda = (parallel_adapter_baseline(CodaConfig()) if variant['attention'] is None
            else CodaConfig(reduction_factor=variant['reduction_factor'],
                            attention=variant['attention']))
    plan = plan_lib.resolve(config, coda, target=_tpu(chip), length=evidence['length'])
    assert variant['programs'][0]['flipped'] is None
    assert variant['programs'][0]['settings'] == {}
    # The program compiled as today's rules plan it: the first (the plan when
    # measured) or, where a rule changed since to a flip's choice, that flip.
    today = {'routed': None if plan.routed is None else plan.routed.as_dict(),
             'dense': None if plan.dense is None else plan.dense.as_dict()}
    matching = [p for p in variant['programs']
                if {key: p['plan'][key] for key in today} == today]
    assert matching, (f'{chip} {variant["variant"]} n {evidence["length"]}: no program '
                      f'measured as the rules plan it today ({plan.summary()})')
    planned = matching[0]
    for program in variant['programs']:
      if program is planned:
        continue
      assert program[measure] >= planned[measure], (
          f'{chip} {variant["variant"]} n {evidence["length"]}: {program["choices"]} '
          f'has {measure} {program[measure]:.4g}, the plan {planned["choices"]} '
          f'{planned[measure]:.4g}')
      checked += 1
  # Every flip of the encoder's choices (two at least apply to a variant), or
  # the one a file flipped (`--flips`) wherever it applies.
  if len(evidence.get('flips', ('all', 'five'))) == 1:
    assert checked == sum(len(v['programs']) - 1 for v in evidence['variants']) > 0
  else:
    assert checked >= 2 * len(evidence['variants'])


def _tool(name):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, 'tools', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize('folder,tool', [('benchmarks/plan', 'plan_table'),
                                         ('benchmarks/plan/decode', 'decode_plan_evidence')])
def test_the_evidence_readme_holds_the_table_of_the_committed_files(folder, tool):
  """benchmarks/plan/README.md (the encoder's) and benchmarks/plan/decode/
  README.md (the decoding step's) show what the files say: the tool's table
  over every committed file of the folder, byte for byte."""
  folder = os.path.join(ROOT, folder)
  files = sorted(os.path.join(folder, name) for name in os.listdir(folder)
                 if name.endswith('.json'))
  cited = {e for e in _evidence_files() if os.path.dirname(os.path.join(ROOT, e)) == folder}
  assert cited and {os.path.relpath(f, ROOT) for f in files} >= cited
  with open(os.path.join(folder, 'README.md')) as f:
    readme = f.read()
  command = ('python tools/plan_table.py benchmarks/plan/*.json' if tool == 'plan_table' else
             'python tools/decode_plan_evidence.py --table benchmarks/plan/decode/*.json')
  assert _tool(tool).table(files) in readme, f'run: {command}'


def test_the_kernels_page_shows_the_rules():
  """docs/kernels.md holds `RULES` as they are (`plan.rules_table`)."""
  with open(os.path.join(ROOT, 'docs', 'kernels.md')) as f:
    page = f.read()
  assert plan_lib.rules_table() in page, 'paste plan.rules_table() into docs/kernels.md'


@pytest.mark.parametrize('platform,kind,tokens,usage,inference,training,expected,why', [
    # A CPU's decoding step of a few rows: masked.
    ('cpu', None, 4, (0.9, 0.4, 0.15, 0.05), 'auto', False, 'masked', 'tokens <= 32'),
    # An encoder's 1536 tokens that keep 0.46 of the learner work: gathered.
    ('cpu', None, 1536, (0.9, 0.4, 0.15, 0.05), 'auto', False, 'gather', 'no rule for cpu'),
    # ... and 0.89 of it: gathered too; 256 tokens at 0.89: masked.
    ('cpu', None, 1536, (0.98, 0.87, 0.76, 0.48), 'auto', False, 'gather', 'no rule for cpu'),
    ('cpu', None, 256, (0.98, 0.87, 0.76, 0.48), 'auto', False, 'masked',
     '0.8 < learner work <= 1, tokens <= 256'),
    # A chip with no ACM row gets the default, gathers.
    ('tpu', 'v4', 4, (0.9, 0.4, 0.15, 0.05), 'auto', False, 'gather', 'no rule for v4'),
    # Training, or no recorded usage: masked; a setting by name is obeyed.
    ('cpu', None, 1536, (0.9, 0.4, 0.15, 0.05), 'auto', True, 'masked', 'training'),
    ('cpu', None, 1536, None, 'auto', False, 'masked', 'no AcmConfig.learner_usage'),
    ('cpu', None, 4, (0.9, 0.4, 0.15, 0.05), 'gather', False, 'gather',
     "AcmConfig.inference = 'gather'"),
])
def test_acm_inference_from_the_rows(platform, kind, tokens, usage, inference, training,
                                     expected, why):
  acm = AcmConfig(num_learners=4, inference=inference, learner_usage=usage)
  where = Target(platform, KIND[kind] if kind else None)
  choice, reason = plan_lib.resolve_acm(acm, where, tokens, training=training)
  assert choice == expected and why in reason, reason
  assert plan_lib.resolve_acm(None, where, tokens) == (None, None)
  assert plan_lib.resolve_acm(dataclasses.replace(acm, decoder=False), where, tokens,
                              'decoder') == (None, None)
  plan = plan_lib.resolve(tiny_config(), acm=acm, target=where, length=tokens,
                          training=training)
  assert plan.acm == expected and f'acm {expected}' in plan.summary()
