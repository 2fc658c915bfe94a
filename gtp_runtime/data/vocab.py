"""The vocabulary size of a prepared dataset, read from ``PREFIX.tokenizer.json`` next to it.

Why: ``prepare --tokenizer bpe`` writes the tokenizer beside the data, and a run that forgot
``--vocab-size`` then either refused the data (ids past 256) or, worse, trained on a smaller
vocabulary than the file. The launcher takes the size from the file when ``--vocab-size`` is not
given. Read as JSON (HF ``tokenizers``' own format), so training needs no ``tokenizers`` package;
the size is the largest id in the model's vocabulary or the added tokens, plus one, which is what
the embedding must hold (``Tokenizer.get_vocab_size()`` for the files ``prepare`` writes).
"""

from __future__ import annotations

import os
from pathlib import Path

from gtp_format.errors import FormatError
from gtp_format.safe_json import Budget, loads
from gtp_runtime.data.indexed import DataError

TOKENIZER_SUFFIX = ".tokenizer.json"
MAX_TOKENIZER_BYTES = 256 << 20  # a 1M-token BPE file is about 60 MB
# parsed: a token is a vocab member and about one merge (2-3 values each); 4M values is a 1M-token file
TOKENIZER_BUDGET = Budget(MAX_TOKENIZER_BYTES, 4 << 20, "a tokenizer of up to a million tokens")


def tokenizer_path(prefix: str | os.PathLike) -> Path:
    p = Path(prefix)
    return p.with_name(p.name + TOKENIZER_SUFFIX)


def tokenizer_vocab_size(prefix: str | os.PathLike) -> int | None:
    """The vocabulary size of ``PREFIX.tokenizer.json``, or None when there is no such file."""
    path = tokenizer_path(prefix)
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise DataError(f"{path}: over {MAX_TOKENIZER_BYTES >> 20} MiB, too large for a tokenizer file; "
                            "pass --vocab-size")
        # the bounded JSON reader: ASCII-checked numbers, no lone surrogates, containers held to the bytes
        doc = loads(path.read_bytes(), str(path), "fix or remove it, or pass --vocab-size", TOKENIZER_BUDGET)
        ids = [v for v in doc["model"]["vocab"].values() if type(v) is int]
        ids += [t["id"] for t in doc.get("added_tokens") or [] if type(t.get("id")) is int]
    except FormatError as e:
        raise DataError(e.message) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a tokenizers JSON file with a model vocabulary ({type(e).__name__}); "
                        "fix or remove it, or pass --vocab-size") from None
    if not ids or min(ids) < 0:
        raise DataError(f"{path}: no token ids (or a negative one); fix or remove it, or pass --vocab-size")
    return max(ids) + 1
