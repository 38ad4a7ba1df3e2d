"""The shared checks: `validation.positive_int` and `attention.real_token_mask`."""
import argparse

import numpy as np
import pytest

from coda_jax.model import attention
from coda_jax.model import layers
from coda_jax import validation
from coda_jax.config import AcmConfig, CodaConfig, SoftTopKConfig, T5Config


@pytest.mark.parametrize('value', [1, 7, np.int32(3), np.int64(2**40)])
def test_positive_int_returns_a_python_int(value):
  got = validation.positive_int(value, 'X')
  assert got == int(value) and type(got) is int  # pylint: disable=unidiomatic-typecheck


@pytest.mark.parametrize('value', [0, -2, 2.0, 2.5, True, None, '3', np.float32(4)])
def test_positive_int_names_the_value(value):
  with pytest.raises(ValueError) as e:
    validation.positive_int(value, 'T5Config.emb_dim')
  assert str(e.value) == f'T5Config.emb_dim must be a positive integer, got {value!r}'


def test_positive_int_raises_the_callers_error():
  class ConfigError(Exception):
    pass
  with pytest.raises(ConfigError, match=r'^TRAIN_STEPS must be a positive integer, got 0$'):
    validation.positive_int(0, 'TRAIN_STEPS', ConfigError)
  # For a flag parser (argparse prefixes the flag): no name.
  with pytest.raises(argparse.ArgumentTypeError,
                     match=r'^must be a positive integer, got -1$'):
    validation.positive_int(-1, error=argparse.ArgumentTypeError)


def test_the_config_fields_use_it():
  for make, field in ((lambda: T5Config(num_heads=0), 'T5Config.num_heads'),
                      (lambda: SoftTopKConfig(num_iters=2.0), 'SoftTopKConfig.num_iters'),
                      (lambda: CodaConfig(adapter_dim=0), 'CodaConfig.adapter_dim'),
                      (lambda: CodaConfig(adapter='lora', lora_rank=0), 'CodaConfig.lora_rank'),
                      (lambda: AcmConfig(num_learners=True), 'AcmConfig.num_learners'),
                      (lambda: AcmConfig(gate_dim=-1), 'AcmConfig.gate_dim')):
    with pytest.raises(ValueError, match=rf'^{field} must be a positive integer, got '):
      make()
  # Without LoRA its rank is not read.
  assert CodaConfig(lora_rank=0).lora_rank == 0


def test_real_token_mask():
  tokens = np.array([[37, 5, 1, 0, 0], [1, 0, 0, 0, 0]], np.int32)
  np.testing.assert_array_equal(
      np.asarray(attention.real_token_mask(tokens)),
      [[True, True, True, False, False], [True, False, False, False, False]])
  # The decoder's mask: causal, and no query or key on padding.
  mask = np.asarray(attention.make_decoder_mask(tokens[:1]))[0, 0]
  np.testing.assert_array_equal(mask, np.tril(np.ones((5, 5))) * [1, 1, 1, 0, 0]
                                * np.array([1, 1, 1, 0, 0])[:, None])
