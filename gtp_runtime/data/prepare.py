"""``python -m gtp_runtime.data prepare``: text files to a Megatron indexed dataset.

One document per input file (or per line with ``--jsonl``'s ``text`` field), each ending in the
end-of-document token, as Megatron's ``tools/preprocess_data.py --append-eod`` writes them. Empty
documents are skipped (and counted), as Megatron's preprocessing skips them.

Tokenizers, both local (nothing is downloaded):

- ``byte`` (default): the UTF-8 bytes, vocab 256, byte 0 as end-of-document. Needs no extra
  package and no training, which is why it is the default.
- ``bpe``: a byte-level BPE trained on the input files with HF ``tokenizers`` (``pip install
  tokenizers``, in the ``bpe`` extra), saved as ``PREFIX.tokenizer.json``. Its
  ``<|endoftext|>`` is id 0. The launcher reads the vocabulary size from that file.

Bad input is one line naming the file and the fix, exit 2, and nothing written: text that is not
UTF-8 (a binary file), a JSON line without a string ``text``, a document over
:data:`MAX_DOCUMENT_BYTES` (memory is bounded by one document, not by what a file declares), no
document at all, an unreadable file, an output prefix that cannot be a file. An existing dataset
at PREFIX is kept unless ``--force`` says to replace it.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gtp_format.errors import FormatError
from gtp_format.numbers import OneLineParser, int_flag
from gtp_format.safe_json import loads
from gtp_format.text import safe_text
from gtp_runtime.data.indexed import DataError
from gtp_runtime.data.vocab import tokenizer_path
from gtp_runtime.data.writer import write_dataset

EOD_TEXT = "<|endoftext|>"
MAX_DOCUMENT_BYTES = 256 << 20  # one document is held in memory while it is tokenized
EXAMPLES = """examples:
  python -m gtp_runtime.data prepare --input 'docs/*.md' --output-prefix runs/data/docs
  python -m gtp_runtime.data prepare --input /usr/lib/python3.11 --glob '*.py' --output-prefix runs/data/py \\
      --tokenizer bpe --vocab-size 4096
  python -m gtp_runtime.data prepare --input corpus.jsonl --jsonl --output-prefix runs/data/corpus --force
  python -m gtp_runtime.train --nproc-per-node 2 --cp 2 --fold-cp --data-path runs/data/docs --steps 20
"""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class Counts:
    documents: int = 0
    empty: int = 0


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


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it to "
                        "UTF-8 or leave it out of --input/--glob") from None


def _too_large(where: str) -> DataError:
    return DataError(f"{where}: a document over {MAX_DOCUMENT_BYTES >> 20} MiB; split it into smaller files "
                     "or JSON lines")


def _file_texts(f: Path, jsonl: bool) -> Iterator[str]:
    with open(f, "rb") as fh:
        if not jsonl:
            data = fh.read(MAX_DOCUMENT_BYTES + 1)
            if len(data) > MAX_DOCUMENT_BYTES:
                raise _too_large(str(f))
            yield _decode(data, str(f))
            return
        for n, raw in enumerate(iter(lambda: fh.readline(MAX_DOCUMENT_BYTES + 1), b""), 1):
            if len(raw) > MAX_DOCUMENT_BYTES:
                raise _too_large(f"{f}:{n}")
            line = _decode(raw, f"{f}:{n}")
            if not line.strip():
                continue
            try:  # the bounded JSON reader: a lone surrogate ("\ud800") cannot become UTF-8 tokens
                doc = loads(raw, "it", "fix the line or drop --jsonl")
            except FormatError as e:
                raise DataError(f"{f}:{n}: not a JSON object with a 'text' field: {e.message}") from None
            text = doc.get("text") if isinstance(doc, dict) else None
            if not isinstance(doc, dict) or "text" not in doc:
                raise DataError(f"{f}:{n}: not a JSON object with a 'text' field; fix the line or drop --jsonl")
            if not isinstance(text, str):
                raise DataError(f"{f}:{n}: 'text' must be a string, got {type(text).__name__}; fix the line")
            yield text


def texts(files: list[Path], jsonl: bool, counts: Counts | None = None) -> Iterator[str]:
    """Every non-empty document of ``files``; ``counts`` (if given) counts them and the empty ones."""
    for f in files:
        try:
            for text in _file_texts(f, jsonl):
                if not text.strip():
                    if counts is not None:
                        counts.empty += 1
                    continue
                if counts is not None:
                    counts.documents += 1
                yield text
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror or e}; fix its permissions or leave it out of --input") \
                from None


def byte_documents(docs: Iterator[str]) -> Iterator[np.ndarray]:
    for text in docs:
        b = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        yield np.concatenate([b[b != 0], [0]]).astype(np.uint8)


def train_bpe(files: list[Path], jsonl: bool, vocab_size: int, out: Path) -> object:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise DataError("--tokenizer bpe needs HF tokenizers; pip install tokenizers (or use the default "
                        "--tokenizer byte)") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(files, jsonl), trainer=trainer)
    tok.save(str(out))
    return tok


def check_output(prefix: Path, tokenizer: str, force: bool) -> None:
    """Refuse, before reading any input, an output that cannot be written or would replace a dataset."""
    if prefix.name in ("", ".", "..") or prefix.is_dir():
        raise DataError(f"--output-prefix {prefix}: a folder, not a file prefix; give PREFIX as in DIR/name "
                        "(writes DIR/name.bin and DIR/name.idx)")
    parent = prefix.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise DataError(f"--output-prefix {prefix}: {p} is a file, not a folder; choose another prefix")
            break
    outputs = [Path(f"{prefix}.bin"), Path(f"{prefix}.idx")] + ([tokenizer_path(prefix)] if tokenizer == "bpe" else [])
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not force:
        raise DataError(f"{existing[0]} exists; pass --force to replace the dataset at {prefix}, or choose another "
                        "--output-prefix")
    if any(p.is_dir() for p in outputs):
        raise DataError(f"{next(p for p in outputs if p.is_dir())} is a folder; choose another --output-prefix")


def _non_empty(docs: Iterator[np.ndarray], files: list[Path]) -> Iterator[np.ndarray]:
    """``docs``, refused before anything is written when there is none (an empty dataset trains nothing)."""
    first = next(docs, None)
    if first is None:
        raise DataError(f"no documents in {_count(len(files), 'input file')} (every one is "
                        "empty); check --input, --glob and --jsonl")
    return itertools.chain([first], docs)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m gtp_runtime.data prepare", description=__doc__.split("\n\n")[0],
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="files, folders (searched with --glob) or globs")
    ap.add_argument("--glob", default="*", help="file pattern inside input folders (default: *)")
    ap.add_argument("--jsonl", action="store_true", help="inputs are JSON lines with a 'text' field (default: off)")
    ap.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte", help="(default: byte)")
    ap.add_argument("--vocab-size", type=int_flag(), default=4096,
                    help="BPE vocab size; byte is always 256 (default: 4096)")
    ap.add_argument("--force", action="store_true", help="replace an existing dataset at PREFIX (default: refuse)")
    return ap


def prepare(args: argparse.Namespace) -> str:
    """Write the dataset; return the summary line."""
    prefix = Path(args.output_prefix)
    if args.tokenizer == "bpe" and not 257 <= args.vocab_size <= 1 << 31:
        raise DataError(f"--vocab-size {args.vocab_size} must be in 257..2**31 for BPE")
    check_output(prefix, args.tokenizer, args.force)
    files = input_files(args.input, args.glob)
    if not files:
        raise DataError(f"no input files match {args.input}; check --input and --glob")
    counts = Counts()
    if args.tokenizer == "byte":
        vocab, n = 256, write_dataset(prefix, _non_empty(byte_documents(texts(files, args.jsonl, counts)), files),
                                      np.uint8)
    else:
        final = tokenizer_path(prefix)
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        try:
            tok = train_bpe(files, args.jsonl, args.vocab_size, tmp)
            vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
            eod = tok.token_to_id(EOD_TEXT)  # type: ignore[attr-defined]
            dtype = np.uint16 if vocab <= 1 << 16 else np.int32
            docs = (np.array(tok.encode(t).ids + [eod], dtype=np.int64)  # type: ignore[attr-defined]
                    for t in texts(files, args.jsonl, counts))
            n = write_dataset(prefix, _non_empty(docs, files), dtype)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    skipped = f"; skipped {counts.empty} empty" if counts.empty else ""
    return (f"wrote {prefix}.bin/.idx: {_count(counts.documents, 'document')} from {_count(len(files), 'file')}, "
            f"{_count(n, 'token')}, vocab {vocab} ({args.tokenizer}){skipped}; "
            f"train with --data-path {prefix}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        line = prepare(args)
    except DataError as e:
        print(f"error: {safe_text(' '.join(str(e).split()))}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        print(safe_text(f"error: cannot write{where}: {e.strerror or e}; check --output-prefix"), file=sys.stderr)
        return 2
    print(safe_text(line))
    return 0
