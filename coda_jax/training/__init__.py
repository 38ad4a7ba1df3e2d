"""Training: the trainer loop, t5x's Adafactor on trainable leaves, schedules,
k annealing and metric writers.

  schedules    learning-rate schedules (t5x factor strings, cosine)
  optimizer    t5x-default Adafactor (optax) + the frozen-parameter mask
  k_annealing  the ladder of routed-token counts k (paper App. A)
  trainer      sharded state and one jitted train step per k value
  data         seqio input pipeline and task-metric evaluation (data extra)
  metrics      metrics.jsonl, TensorBoard, progress bar
  gin_utils    gin flags and files in t5x's style, and their error messages
  train_lib    `train(...)`, the gin-configured run (`python -m coda_jax.train`)
"""
