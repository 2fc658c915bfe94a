"""``python -m gtp_runtime.data prepare``: text files to a Megatron indexed dataset.

One document per input file (or per line with ``--jsonl``'s ``text`` field), each ending in the
end-of-document token, as Megatron's ``tools/preprocess_data.py --append-eod`` writes them.

Tokenizers, both local (nothing is downloaded):

- ``byte`` (default): the UTF-8 bytes, vocab 256, byte 0 as end-of-document. Needs no extra
  package and no training, which is why it is the default.
- ``bpe``: a byte-level BPE trained on the input files with HF ``tokenizers`` (``pip install
  tokenizers``, in the ``bpe`` extra), saved as ``PREFIX.tokenizer.json``. Its
  ``<|endoftext|>`` is id 0. Train with ``--vocab-size`` equal to the tokenizer's size.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from gtp_runtime.data.writer import write_dataset

EOD_TEXT = "<|endoftext|>"
EXAMPLES = """examples:
  python -m gtp_runtime.data prepare --input 'docs/*.md' --output-prefix runs/data/docs
  python -m gtp_runtime.data prepare --input /usr/lib/python3.11 --glob '*.py' --output-prefix runs/data/py \\
      --tokenizer bpe --vocab-size 4096
  python -m gtp_runtime.data prepare --input corpus.jsonl --jsonl --output-prefix runs/data/corpus
"""


def input_files(inputs: list[str], pattern: str) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob(pattern) if q.is_file()))
        elif p.is_file():
            files.append(p)
        else:
            files.extend(sorted(q for q in map(Path, glob.glob(item, recursive=True)) if q.is_file()))
    return files


def texts(files: list[Path], jsonl: bool) -> Iterator[str]:
    for f in files:
        if not jsonl:
            yield f.read_text(encoding="utf-8", errors="replace")
            continue
        with open(f, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield str(json.loads(line)["text"])
                    except (ValueError, KeyError, TypeError) as e:
                        raise SystemExit(f"error: {f}:{n}: not a JSON object with a 'text' field ({e})") from None


def byte_documents(docs: Iterator[str]) -> Iterator[np.ndarray]:
    for text in docs:
        b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        yield np.concatenate([b[b != 0], [0]]).astype(np.uint8)


def train_bpe(files: list[Path], jsonl: bool, vocab_size: int, out: Path) -> object:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise SystemExit("error: --tokenizer bpe needs HF tokenizers; pip install tokenizers "
                         "(or use the default --tokenizer byte)") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(files, jsonl), trainer=trainer)
    tok.save(str(out))
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gtp_runtime.data prepare", description=__doc__.split("\n\n")[0],
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="files, folders (searched with --glob) or globs")
    ap.add_argument("--glob", default="*", help="file pattern inside input folders")
    ap.add_argument("--jsonl", action="store_true", help="inputs are JSON lines with a 'text' field")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocab size (byte: always 256)")
    args = ap.parse_args(argv)
    files = input_files(args.input, args.glob)
    if not files:
        print(f"error: no input files match {args.input}; check --input and --glob", file=sys.stderr)
        return 2
    prefix = Path(args.output_prefix)
    if args.tokenizer == "byte":
        vocab, n = 256, write_dataset(prefix, byte_documents(texts(files, args.jsonl)), np.uint8)
    else:
        if not 257 <= args.vocab_size <= 1 << 31:
            print(f"error: --vocab-size {args.vocab_size} must be in 257..2**31 for BPE", file=sys.stderr)
            return 2
        prefix.parent.mkdir(parents=True, exist_ok=True)
        tok = train_bpe(files, args.jsonl, args.vocab_size, prefix.with_name(prefix.name + ".tokenizer.json"))
        vocab = tok.get_vocab_size()
        eod = tok.token_to_id(EOD_TEXT)
        dtype = np.uint16 if vocab <= 1 << 16 else np.int32
        docs = (np.array(tok.encode(t).ids + [eod], dtype=np.int64) for t in texts(files, args.jsonl))
        n = write_dataset(prefix, docs, dtype)
    print(f"wrote {prefix}.bin/.idx: {len(files)} files, {n} tokens, vocab {vocab} ({args.tokenizer}); train with "
          f"--data-path {prefix} --vocab-size {vocab}")
    return 0
