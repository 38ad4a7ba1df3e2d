"""Shared test set-up: tests run in any order, so no gin binding outlives its test."""
import coda_jax  # noqa: F401  (first: a libtpu installed without a TPU stays quiet)
import gin
import pytest


@pytest.fixture(autouse=True)
def _fresh_gin_config():
  yield
  gin.clear_config()
