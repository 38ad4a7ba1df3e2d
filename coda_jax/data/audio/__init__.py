"""Speech input (io, features, dtmf and whisper_features NumPy over the
config; tasks seqio; whisper_tokenizer the `tokenizers` library):

  io        `read_audio`: WAV / FLAC files to float32 mono waveforms in
            [-1, 1] at the asked sample rate (`resample_waveform`: a
            polyphase windowed-sinc resampler, scipy's `resample_poly`)
  features  the log-mel front end (`AudioConfig`): frames, Hann window,
            power spectrum, mel filterbank (librosa's), log with a floor;
            `batch_log_mel`: a padded batch and its mask `[batch, frames]`
  dtmf      generated speech for a quickstart: DTMF key tones among silence,
            their frame labels (`tone_frames`) and word vocabulary
  whisper_features   Whisper's log-mel `input_features` (`WhisperFeaturesConfig`:
            30 s windows, 80 or 128 bins; transformers' `WhisperFeatureExtractor`)
  whisper_tokenizer  a Whisper checkpoint's `tokenizer.json`: text to ids and
            back, the start-of-transcript prefix read from the file
  tasks     the speech seqio tasks (a directory of WAV / FLAC + JSONL,
            TFDS LibriSpeech, generated DTMF): `[frames, 1 + num_mels]`
            inputs, labels without EOS, WER; `check_model`, the feature
            converter, `example_inputs`
  whisper_tasks  the directory and LibriSpeech tasks in Whisper's features and
            tokens (a checkpoint's tokenizer.json and preprocessor_config.json),
            its vocabulary, feature converter and decoder prompt; WER after
            Whisper's normaliser

Import the modules themselves (`from coda_jax.data.audio import features`).
"""
