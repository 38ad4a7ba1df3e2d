"""Speech (the CoDA paper's §6: a Transformer encoder over log-mels and a
2-layer LSTM transducer, RNN-T, Graves 2012). Each module imports on its
own; this package imports none of them.

  specaugment           frequency and time masking of log-mels (training)
  stem                  4x convolutional subsampling of log-mels to the
                        encoder's width
  rnnt                  the RNN-T loss: -log P(y | x) over the T x (U+1)
                        lattice, a scan over its diagonals, a custom VJP
  transducer            the prediction network (label embedding + LSTMs,
                        its state for decoding) and the joint network
  transducer_decoding   greedy and beam search (time-synchronous, a cap on
                        labels per frame)
  bestrq                BEST-RQ pre-training (Chiu et al. 2022): the frozen
                        random-projection quantizer's labels, span masks
                        with noise, target frames, the softmax head and loss
  whisper_stem          Whisper's encoder input: two 1-D convolutions (the
                        second of stride 2) and its sinusoidal positions
"""
