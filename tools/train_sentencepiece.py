"""Trains a SentencePiece model of a speech task's transcripts (the output
vocabulary of an RNN-T speech model).

Default: a 1024-piece unigram model, as the LibriSpeech recipes use
(ESPnet's, Lingvo's and BEST-RQ's word pieces); ``--model_type bpe`` for
byte-pair encoding. Ids follow T5's and seqio's layout, so that
`seqio.SentencePieceVocabulary(<out>.model)` reads it: 0 pad (the RNN-T's
blank), 1 EOS, 2 unknown, no BOS, pieces from 3; the transducer's
`TransducerConfig.vocab_size` is then pieces - 1 (the joint's outputs are
the vocabulary's ids). Training is deterministic (one thread, every
sentence read in order, no sampling): the same transcripts give the same
model file.

Transcripts come from a registered speech task's split (``--task
coda_librispeech --split train``: only the text is read, not the audio;
``coda_speech_directory`` reads AUDIO_DATA_DIR, given as ``--data_dir``) or
from a JSONL file of ``{"audio": ..., "text": ...}`` lines (``--jsonl``).
Prints JSON: the model file, its pieces, the examples read, their
characters, ``coverage`` (the share of transcripts that encode and decode
back to themselves, whitespace aside) and ``unk_rate`` (unknown pieces per
piece).

  python tools/train_sentencepiece.py --task coda_librispeech --split train \
      --out vocab/librispeech_1024
  python tools/train_sentencepiece.py --jsonl data/train.jsonl --out vocab/mine \
      --vocab_size 256 --model_type bpe
"""
import argparse
import json
import os
import sys
from typing import List, Optional

from coda_jax.validation import positive_int

MODEL_TYPES = ('unigram', 'bpe')
DEFAULT_VOCAB_SIZE = 1024


def read_transcripts(args) -> List[str]:
  from coda_jax.data.audio import tasks as audio_tasks  # pylint: disable=g-import-not-at-top
  if args.jsonl:
    texts = [r[audio_tasks.TEXT] for r in audio_tasks.read_jsonl(args.jsonl)]
  else:
    if args.data_dir:
      import gin  # pylint: disable=g-import-not-at-top
      with gin.unlock_config():
        gin.bind_parameter('coda_jax.audio_tasks.AudioTaskSettings.data_dir', args.data_dir)
    texts = audio_tasks.transcripts(args.task, args.split, args.max_examples)
  texts = [' '.join(t.split()) for t in texts]
  return [t for t in texts if t][:args.max_examples]


def train(texts: List[str], out: str, vocab_size: int, model_type: str,
          character_coverage: float) -> str:
  """Writes `<out>.model` (and `<out>.vocab`); returns the model's path."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  directory = os.path.dirname(os.path.abspath(out))
  os.makedirs(directory, exist_ok=True)
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=out, vocab_size=vocab_size,
        model_type=model_type, character_coverage=character_coverage,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, num_threads=1,
        input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
  except RuntimeError as e:
    reason = (str(e).strip().splitlines() or [''])[-1]
    raise ValueError(f'SentencePiece could not train {vocab_size} {model_type} pieces on '
                     f'{len(texts)} transcripts: {reason}') from None
  return out + '.model'


def report(model: str, texts: List[str], model_type: str) -> dict:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  processor = spm.SentencePieceProcessor(model_file=model)
  pieces = unknown = exact = 0
  for text in texts:
    ids = processor.encode(text)
    pieces += len(ids)
    unknown += sum(1 for i in ids if i == processor.unk_id())
    exact += ' '.join(processor.decode(ids).split()) == text
  return {'model': model, 'model_type': model_type, 'pieces': processor.get_piece_size(),
          'ids': {'pad': processor.pad_id(), 'eos': processor.eos_id(),
                  'unk': processor.unk_id(), 'first_piece': 3},
          'transducer_vocab_size': processor.get_piece_size() - 1,
          'examples': len(texts), 'characters': sum(len(t) for t in texts),
          'coverage': exact / len(texts), 'unk_rate': unknown / max(pieces, 1),
          'pieces_per_example': pieces / len(texts)}


def _fraction(text: str) -> float:
  value = float(text)
  if not 0.0 < value <= 1.0:
    raise argparse.ArgumentTypeError(f'must be in (0, 1], got {text}')
  return value


def _positive(text: str) -> int:
  try:
    return positive_int(int(text), 'the value', argparse.ArgumentTypeError)
  except ValueError:
    raise argparse.ArgumentTypeError(f'must be a positive integer, got {text!r}') from None


def main(argv: Optional[List[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog='python tools/train_sentencepiece.py',
                                   description=__doc__.split('\n')[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--task', help='a registered speech task (coda_librispeech, '
                      'coda_speech_directory, coda_quickstart_dtmf)')
  source.add_argument('--jsonl', help='a JSONL file of {"audio": ..., "text": ...} lines')
  parser.add_argument('--split', default='train', help="the task's split (default train)")
  parser.add_argument('--data_dir', help="coda_speech_directory's directory (AUDIO_DATA_DIR)")
  parser.add_argument('--out', required=True, help='writes <out>.model and <out>.vocab')
  parser.add_argument('--vocab_size', type=_positive, default=DEFAULT_VOCAB_SIZE,
                      help=f'pieces, pad / EOS / unknown included (default '
                      f'{DEFAULT_VOCAB_SIZE})')
  parser.add_argument('--model_type', choices=MODEL_TYPES, default='unigram')
  parser.add_argument('--character_coverage', type=_fraction, default=1.0,
                      help='share of the characters the pieces cover (default 1.0: all)')
  parser.add_argument('--max_examples', type=_positive, default=None,
                      help='read at most this many transcripts (needed for a generated '
                      "task's endless train split)")
  args = parser.parse_args(argv)
  try:
    texts = read_transcripts(args)
    if not texts:
      raise ValueError('no transcripts to train on')
    model = train(texts, args.out, args.vocab_size, args.model_type, args.character_coverage)
  except (ValueError, OSError) as e:
    parser.exit(2, f'{parser.prog}: error: {e}\n')
  print(json.dumps(report(model, texts, args.model_type), indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
