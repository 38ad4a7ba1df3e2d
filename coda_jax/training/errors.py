"""The errors a training or inference run reports to its user as written."""


class UserFacingError(Exception):
  """An error whose message is for the user as written.

  gin appends "In call to configurable ..." to exceptions raised inside a
  configurable; `message` keeps the original text for the command line.
  """

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message


class ConfigError(UserFacingError, ValueError):
  """A configuration that cannot run (found before any computation)."""


class NonFiniteLossError(UserFacingError, FloatingPointError):
  """The loss (or a trained parameter) became NaN or infinite."""


class PreemptedError(UserFacingError):
  """A multi-process run stopped at a preemption notice, after a checkpoint."""


class DataError(ConfigError):
  """The run's data is not there and cannot be fetched (found before any
  checkpoint is read)."""
