"""Shared test set-up: tests run in any order, so no gin binding outlives its test."""
import gin
import pytest


@pytest.fixture(autouse=True)
def _fresh_gin_config():
  yield
  gin.clear_config()
