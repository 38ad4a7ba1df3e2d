"""coda_jax: Conditional Adapters for T5 v1.1 in JAX/Flax."""
from coda_jax import quiet as _quiet

# Before JAX starts a backend: a libtpu installed for `coda-jax compile` on a
# machine without a TPU stays quiet (`quiet.quiet_libtpu`).
_quiet.quiet_libtpu()
