"""The tiny T5 v1.1-shaped configuration the model tests share."""
from coda_jax.config import t5_1_1

TINY = dict(vocab_size=64, emb_dim=32, num_heads=4, head_dim=8, mlp_dim=48,
            num_encoder_layers=2, num_decoder_layers=2)


def tiny_config(**overrides):
  """T5 v1.1 'small' with TINY's sizes (and `overrides`)."""
  return t5_1_1('small', **{**TINY, **overrides})


def beam_decode_each(config, field: str, plan_field: str):
  """A tiny T5 of `config` beam-decoded (3 beams, 6 tokens) on three
  examples (one padded) with `config.field` 'xla' and then 'pallas' (the
  kernels in interpret mode), from the same parameters. Returns {setting:
  ((sequences, scores), the decoder plans' `plan_field` at its 9 rows, the
  Pallas calls in the program)}."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from coda_jax.model import decoding  # pylint: disable=g-import-not-at-top
  from coda_jax import plan as plan_lib  # pylint: disable=g-import-not-at-top
  from coda_jax.model.network import Transformer  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  tokens = rng.randint(2, 64, (3, 11)).astype(np.int32)
  tokens[1, 7:] = 0
  models = {k: Transformer(dataclasses.replace(config, **{field: k})) for k in ('xla', 'pallas')}
  params = models['xla'].init(jax.random.PRNGKey(1), tokens, tokens[:, :4], tokens[:, :4],
                              enable_dropout=False)['params']
  out = {}
  for name, model in models.items():
    decode = functools.partial(decoding.predict_batch, model, max_decode_length=6,
                               method='beam', num_beams=3, eos_id=1)
    with plan_lib.recording() as plans:
      result = jax.jit(decode)(params, tokens)
    chosen = {getattr(p, plan_field) for p in plans
              if isinstance(p, plan_lib.DecoderPlan) and p.batch == 9}
    calls = str(jax.make_jaxpr(decode)(params, tokens)).count('pallas_call')
    out[name] = (result, chosen, calls)
  return out


def decode_step_by_step(step, tokens, cache):
  """Feeds `tokens [batch, length]` one position at a time to
  `step(tokens [batch, 1], cache) -> (logits [batch, vocab], cache)`
  (`decoding.make_tokens_to_logits`); returns ([batch, length, vocab], cache)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  logits = []
  for i in range(tokens.shape[1]):
    step_logits, cache = step(tokens[:, i:i + 1], cache)
    logits.append(step_logits)
  return jnp.stack(logits, 1), cache


def run_on_cpu_devices(script: str, count: int = 4) -> dict:
  """Runs `script` (Python source) in a subprocess with `count` CPU devices
  from the repository root; returns the JSON object of its last output line."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=os.environ.get('XLA_FLAGS', '') +
             f' --xla_force_host_platform_device_count={count}')
  proc = subprocess.run([sys.executable, '-c', script], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


_BATCH_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from flax.linen import partitioning as nn_partitioning
from coda_jax import partitioning
from coda_jax.kernels import {module} as kernel
sys.path.insert(0, 'tests')
from {test_module} import _operands
args = _operands{operands}
call = lambda *a: kernel.{function}(*a, interpret=True)
expected = call(*args)
fn = jax.jit(call)
with jax.set_mesh(partitioning.create_mesh((4, 1))), nn_partitioning.axis_rules(
    partitioning.standard_logical_axis_rules()):
  text = str(jax.make_jaxpr(fn)(*args))
  out = fn(*args)
print(json.dumps({{'shard_map': 'shard_map' in text, 'diff': max(
    float(np.abs(np.asarray(o) - np.asarray(e)).max())
    for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(expected)))}}))
"""


def kernel_under_batch_mesh(module: str, function: str, test_module: str,
                            operands: tuple) -> dict:
  """Runs `coda_jax.kernels.<module>.<function>` in interpret mode on
  `<test_module>._operands(*operands)`, alone and jitted under a (4, 1) mesh
  of 4 CPU devices with the standard logical rules; returns whether the
  traced call has a `shard_map` and the largest difference of any output."""
  return run_on_cpu_devices(_BATCH_MESH_SCRIPT.format(
      module=module, function=function, test_module=test_module, operands=operands))


# A tiny Whisper's sizes (transformers' WhisperConfig names).
WHISPER_TINY = dict(vocab_size=100, num_mel_bins=8, d_model=16, encoder_layers=2,
                    decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                    encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=16,
                    max_target_positions=16)


def tiny_whisper(directory, pytorch_bin: bool = False, tune=None, **sizes):
  """A tiny random `transformers.WhisperForConditionalGeneration`
  (`WHISPER_TINY`, `sizes` overriding it; every parameter but the encoder's
  sinusoids moved off its init so that biases and norms matter; then
  `tune(model, torch)`, when given) written to `directory` as
  `save_pretrained` writes it (`model.safetensors`); with `pytorch_bin`
  also a copy as `pytorch_model.bin` in `directory`/bin. Returns the model
  (eval mode) and torch."""
  import os  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
  config = transformers.WhisperConfig(**{**WHISPER_TINY, **ids, **sizes})
  model = transformers.WhisperForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'encoder.embed_positions' not in name:
        p.add_(0.1 * torch.randn_like(p))
    if tune is not None:
      tune(model, torch)
  directory = str(directory)
  model.save_pretrained(directory)
  if pytorch_bin:
    os.makedirs(os.path.join(directory, 'bin'), exist_ok=True)
    torch.save(model.state_dict(), os.path.join(directory, 'bin', 'pytorch_model.bin'))
    shutil.copy(os.path.join(directory, 'config.json'), os.path.join(directory, 'bin'))
  return model, torch


def whisper_rows(features, real_frames=None):
  """Whisper's `input_features [batch, mels, frames]` -> this project's rows
  `[batch, frames, 1 + mels]`: the realness column (1.0 for the first
  `real_frames[i]` frames of row i; default every frame), then the log-mels."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  batch, _, frames = features.shape
  real = np.ones((batch, frames), np.float32)
  if real_frames is not None:
    real = (np.arange(frames)[None] < np.asarray(real_frames)[:, None]).astype(np.float32)
  return np.concatenate([real[..., None], features.transpose(0, 2, 1)], -1).astype(np.float32)


# Transcripts a tiny Whisper tokenizer is trained on (`whisper_tokenizer_file`).
WHISPER_SENTENCES = ('one two three four five six seven eight nine zero',
                     'the quick brown fox jumps over the lazy dog',
                     'alpha bravo charlie delta star hash')


def whisper_tokenizer_file(directory, sentences=WHISPER_SENTENCES, languages=('en', 'de')):
  """Writes `directory`/tokenizer.json: a byte-level BPE (GPT-2's pre-
  tokenizer and decoder, as Whisper's) trained with `tokenizers` on
  `sentences` (a few pieces beyond the 256 bytes), then Whisper's special
  tokens in Whisper's order with `languages` only, and <|0.00|>. Returns
  the file's `WhisperTokenizer`."""
  import os  # pylint: disable=g-import-not-at-top
  import tokenizers  # pylint: disable=g-import-not-at-top
  from coda_jax.data.audio import whisper_tokenizer as wt  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False)
  tok.train_from_iterator([' ' + s for s in sentences], trainer)
  specials = [wt.END_OF_TEXT, wt.START_OF_TRANSCRIPT, *[f'<|{l}|>' for l in languages],
              wt.TRANSLATE, wt.TRANSCRIBE, '<|startoflm|>', wt.START_OF_PREV, '<|nospeech|>',
              wt.NO_TIMESTAMPS]
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in specials])
  tok.add_tokens([tokenizers.AddedToken('<|0.00|>', special=False, normalized=False)])
  path = os.path.join(str(directory), wt.TOKENIZER_FILE)
  tok.save(path)
  return wt.WhisperTokenizer.from_file(path)
