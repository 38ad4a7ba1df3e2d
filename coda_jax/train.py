"""``python -m coda_jax.train``: gin-configured training, as t5x's
``python -m t5x.train`` (the command line: `coda_jax.training.command`)."""
import sys

from coda_jax.training.command import (PREEMPTED_EXIT_CODE, add_arguments,  # noqa: F401
                                       add_gin_arguments, check_config, main, run,
                                       run_gin_command)

if __name__ == '__main__':
  sys.exit(main())
