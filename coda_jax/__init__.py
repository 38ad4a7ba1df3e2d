"""coda_jax: Conditional Adapters for T5 v1.1 in JAX/Flax."""
