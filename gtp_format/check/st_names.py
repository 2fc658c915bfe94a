"""Tensor names and dtypes a safetensors file can store: checked before an export writes one.

Why: ``export --to hf`` of a checkpoint with a key named ``__metadata__`` wrote a file whose
header had two ``__metadata__`` entries (ours and the tensor's); ``safetensors`` refused to load
it, yet the export exited 0. A name is untrusted input (a Megatron checkpoint's keys come from its
``.metadata``), so the class is every name the format cannot hold as a tensor name:

* ``__metadata__``: the header's reserved key (the safetensors spec: "the special key
  ``__metadata__`` is allowed to contain a map of string to string");
* a name that is not valid UTF-8 (a lone surrogate): the header is UTF-8 JSON, and the Rust parser
  refuses ``\\udXXX`` escapes that pair with nothing;
* the empty name, and one name twice in one file (a JSON object cannot hold both);
* a dtype without a safetensors code (the header would say ``null``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gtp_format.dtypes import DType
from gtp_format.errors import FormatError

RESERVED = ("__metadata__",)


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a safetensors tensor name, or None."""
    if name in RESERVED:
        return "is the safetensors header's reserved key"
    if not name:
        return "is empty"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (a lone surrogate)"
    return None


def refuse_unstorable(source: object, tensors: Iterable[tuple[str, DType]]) -> None:
    """One line (exit 2) naming the first tensor a safetensors file cannot store, before anything is written."""
    seen: set[str] = set()
    for name, dtype in tensors:
        why = name_problem(name)
        if why is None and name in seen:
            why = "appears twice"
        if why is None and not dtype.safetensors:
            why = f"has dtype {dtype.name}, which safetensors has no code for"
        if why is not None:
            raise FormatError(f"{source}: tensor name {name!r} {why}, so safetensors cannot store it; export --to "
                              "fully_reshardable or --to torch instead, or rename the key in the source")
        seen.add(name)
