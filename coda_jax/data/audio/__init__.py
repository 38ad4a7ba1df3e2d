"""Speech input (NumPy; imports only the config):

  io        `read_audio`: WAV / FLAC files to float32 mono waveforms in
            [-1, 1] at the asked sample rate (`resample_waveform`: a
            polyphase windowed-sinc resampler, scipy's `resample_poly`)
  features  the log-mel front end (`AudioConfig`): frames, Hann window,
            power spectrum, mel filterbank (librosa's), log with a floor;
            `batch_log_mel`: a padded batch and its mask `[batch, frames]`

Import the modules themselves (`from coda_jax.data.audio import features`).
"""
