"""Learning-rate schedules, gin-selectable (t5x's factor strings, and cosine).

`create_learning_rate_scheduler` reads t5x's ``factors`` string, a product of
named factors (``'constant * rsqrt_decay'``):

  constant                 base_learning_rate
  linear_warmup            min(1, step / warmup_steps)
  rsqrt_decay              1 / sqrt(max(step, warmup_steps))   (t5x's inverse
                           square root, flat during warmup)
  rsqrt_normalized_decay   sqrt(warmup_steps) / sqrt(max(step, warmup_steps))
  linear_decay             max(0, 1 - step / total_steps)  (needs total_steps)
  cosine_decay             0.5 * (1 + cos(pi * min(step, total) / total))
                           (needs total_steps)

CoDA's NLP fine-tuning (paper Table 8) is ``factors='constant'``,
``base_learning_rate=1e-3``; T5 pre-training is ``'constant * rsqrt_decay'``
with ``base_learning_rate=1.0, warmup_steps=10000``. `cosine` is optax's warmup
cosine schedule (the paper's vision setting).

A schedule maps the optimizer's update count (0 for the first step) to a
learning rate and is traceable (jnp).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import gin
import jax.numpy as jnp
import optax

from coda_jax.validation import positive_int

Schedule = Callable[[jnp.ndarray], jnp.ndarray]

FACTORS = ('constant', 'linear_warmup', 'rsqrt_decay', 'rsqrt_normalized_decay',
           'linear_decay', 'cosine_decay')


def parse_factors(factors: str):
  """'constant * rsqrt_decay' -> ('constant', 'rsqrt_decay'); unknown names raise."""
  names = tuple(n.strip() for n in factors.split('*') if n.strip())
  if not names:
    raise ValueError(f'empty learning-rate factors string {factors!r}')
  for name in names:
    if name not in FACTORS:
      raise ValueError(f'unknown learning-rate factor {name!r} in {factors!r}; '
                       f'known: {list(FACTORS)}')
  return names


@gin.configurable(module='coda_jax.training.schedules')
def create_learning_rate_scheduler(factors: str = 'constant',
                                   base_learning_rate: float = 1e-3,
                                   warmup_steps: int = 0,
                                   total_steps: Optional[int] = None) -> Schedule:
  """A t5x-style product-of-factors schedule (see the module docstring)."""
  names = parse_factors(factors)
  needs_warmup = {'linear_warmup', 'rsqrt_normalized_decay'} & set(names)
  if needs_warmup and warmup_steps <= 0:
    raise ValueError(f'learning-rate factors {sorted(needs_warmup)} need warmup_steps > 0')
  needs_total = {'linear_decay', 'cosine_decay'} & set(names)
  if needs_total and not total_steps:
    raise ValueError(f'learning-rate factors {sorted(needs_total)} need total_steps')

  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    lr = jnp.asarray(1.0, jnp.float32)
    for name in names:
      if name == 'constant':
        lr = lr * base_learning_rate
      elif name == 'linear_warmup':
        lr = lr * jnp.minimum(1.0, step / warmup_steps)
      elif name == 'rsqrt_decay':
        lr = lr / jnp.sqrt(jnp.maximum(step, max(float(warmup_steps), 1.0)))
      elif name == 'rsqrt_normalized_decay':
        lr = lr * math.sqrt(warmup_steps) / jnp.sqrt(jnp.maximum(step, float(warmup_steps)))
      elif name == 'linear_decay':
        lr = lr * jnp.maximum(0.0, 1.0 - step / total_steps)
      else:  # cosine_decay
        frac = jnp.minimum(step, float(total_steps)) / total_steps
        lr = lr * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    return lr

  return schedule


@gin.configurable(module='coda_jax.training.schedules')
def constant(learning_rate: float = 1e-3, warmup_steps: int = 0) -> Schedule:
  """Constant rate (paper Table 8, NLP), optionally after a linear warmup."""
  factors = 'constant * linear_warmup' if warmup_steps > 0 else 'constant'
  return create_learning_rate_scheduler(factors, learning_rate, warmup_steps)


@gin.configurable(module='coda_jax.training.schedules')
def rsqrt(learning_rate: float = 1.0, warmup_steps: int = 10000) -> Schedule:
  """t5x's inverse square root: learning_rate / sqrt(max(step, warmup_steps))."""
  return create_learning_rate_scheduler('constant * rsqrt_decay', learning_rate,
                                        warmup_steps)


@gin.configurable(module='coda_jax.training.schedules')
def cosine(learning_rate: float = 1e-2, total_steps: Optional[int] = None,
           warmup_steps: int = 0, end_value: float = 0.0) -> Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to `end_value`."""
  total_steps = positive_int(total_steps, "the cosine schedule's total_steps")
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup_steps > 0 else learning_rate, peak_value=learning_rate,
      warmup_steps=int(warmup_steps), decay_steps=max(total_steps, int(warmup_steps) + 1),
      end_value=end_value)
