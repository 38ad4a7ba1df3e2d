"""`config.paper_coda`: the paper's CodaConfig for a model by name (Table 7's
adapter widths, App. C.2's soft top-k), the companion of `config.preset`,
and where the code picks an adapter width per model (the benchmark's
--adapter_dim default) and the model gin files agree with it."""
import argparse

import gin
import pytest

from coda_jax import config
from coda_jax.config import (CODA_TEXT_SIZES, PAPER_ADAPTER_DIMS, PIX2STRUCT_SIZES, PRESETS,
                             SPEECH_SIZES, T5_1_1_SIZES, CodaConfig, paper_coda)


def test_table_7_adapter_widths_by_model():
  # Table 7, d_adpt: Text Base / Large / XL 64, Vision 256, Speech 256.
  assert {m: paper_coda(m).adapter_dim for m in ('text_base', 'text_large', 'text_xl',
                                                 'vision', 'speech_base', 'speech_large',
                                                 'speech_xl')} == {
      'text_base': 64, 'text_large': 64, 'text_xl': 64, 'vision': 256, 'speech_base': 256,
      'speech_large': 256, 'speech_xl': 256}
  assert set(PAPER_ADAPTER_DIMS) == set(CODA_TEXT_SIZES) | {'vision'} | set(SPEECH_SIZES)
  # Models Table 7 does not list: CodaConfig's default.
  for m in tuple(T5_1_1_SIZES) + ('pix2struct_base', 'pix2struct_large'):
    assert paper_coda(m).adapter_dim == CodaConfig().adapter_dim == 64
  assert set(PRESETS) == (set(T5_1_1_SIZES) | set(CODA_TEXT_SIZES) | set(PIX2STRUCT_SIZES)
                          | set(SPEECH_SIZES))


def test_the_rest_is_the_papers_for_text_and_vision():
  coda = paper_coda('vision')
  assert isinstance(coda, CodaConfig)
  # §3 parallel adapters, §5's k-to-all, the soft top-k with App. C.2's
  # ε = 0.03, ε0 = 4, β = 0.7, T = 20 (text and vision models).
  assert (coda.adapter, coda.attention, coda.normalizer) == ('parallel', 'k_to_all',
                                                             'soft_topk')
  s = coda.soft_topk
  assert (s.epsilon, s.epsilon_init, s.epsilon_decay, s.num_iters) == (0.03, 4.0, 0.7, 20)
  assert paper_coda('text_xl') == CodaConfig()
  # App. A: k = 1024 of 4096 patches (r = 4), as a run chooses it.
  assert paper_coda('vision', reduction_factor=4.0).num_selected(4096) == 1024
  assert paper_coda('vision', adapter_dim=32).adapter_dim == 32


def test_an_unknown_model_is_named_with_a_suggestion():
  with pytest.raises(ValueError, match=r"unknown model size 'visoin' \(did you mean "
                     r"'vision'\?\)"):
    paper_coda('visoin')
  assert config.paper_coda is paper_coda


def test_the_benchmark_defaults_to_the_papers_width():
  from coda_jax.measure.bench import decoding_latency  # pylint: disable=g-import-not-at-top

  def template(model, adapter_dim=None):
    args = argparse.Namespace(model=model, adapter_dim=adapter_dim, soft_topk_method='iterative',
                              dispatch='auto')
    return decoding_latency.make_coda_template(args).adapter_dim
  assert (template('vision'), template('text_base'), template('base'), template('tiny'),
          template('vision', 48)) == (256, 64, 64, 64, 48)


@pytest.mark.parametrize('name', ['coda_vision', 'coda_text_base', 'coda_text_large',
                                  'coda_text_xl'])
def test_the_model_gin_files_set_the_papers_width(name):
  gin.clear_config()
  try:
    gin.parse_config_file(f'gin_configs/models/{name}.gin')
    model = 'vision' if name == 'coda_vision' else name[len('coda_'):]
    assert (gin.get_configurable(config.CodaConfig)().adapter_dim
            == paper_coda(model).adapter_dim)
  finally:
    gin.clear_config()
