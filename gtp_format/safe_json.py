"""The one JSON parser for untrusted files (manifest, metadata.json, indexes, safetensors headers).

``json.loads`` on a file nobody vouches for fails in ways a one-line error must cover, and some
of them are not ``JSONDecodeError``:

* an integer of more than 4,300 digits raises ``ValueError`` (CPython's int-conversion limit) and
  a smaller but still absurd one is a size no checkpoint has; ``1e999`` parses as ``inf``;
  ``NaN``/``Infinity`` are accepted by default. All are refused here: a size, shape or offset is a
  plain integer of at most :data:`MAX_INT_DIGITS` digits, and floats are finite;
* nesting raises ``RecursionError`` at about 1,000 levels;
* ``"\\ud800"`` decodes to a lone surrogate, a string that cannot be encoded, printed or used as
  a file name: refused too;
* a file of empty containers (``[],`` is 3 bytes, a list 56 bytes of memory) amplifies memory
  about 20 times, so the number of ``[``/``{`` (counted in C, an upper bound) is held to one per
  :data:`BYTES_PER_CONTAINER` bytes, which genuine files never approach (a safetensors entry
  spends about 20 bytes per container, a manifest more).

Bytes alone do not bound the cost: every parsed value is a Python object of 28-100 bytes, so a
64 MiB file of short values became 740 MB. Each caller therefore passes a :class:`Budget` derived
from what the checkpoint or folder really stores (its chunks, its data files, the model's vocabulary):
a byte limit and a limit on values, counted in C before parsing as an upper bound (commas plus
containers plus one: every element or member after the first follows a comma). A file over either
is one line saying what it holds and what the input can need.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.reader.storage import read_small_file

MAX_INT_DIGITS = 40  # 2**128 has 39 digits; every size, shape and offset is far below
BYTES_PER_CONTAINER = 6
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# metadata.json and the manifest are small (a manifest spends ~200 bytes per parameter: 1 MiB for
# thousands); JSON amplifies memory at most ~12x once safe_json holds containers to one per 6 bytes.
JSON_LIMIT = 16 << 20


class _Refused(ValueError):
    pass


@dataclass(frozen=True)
class Budget:
    """What one JSON input may cost: ``limit`` bytes and ``values`` parsed values at most; ``why``
    names what the budget is derived from, for the message."""

    limit: int = JSON_LIMIT
    values: int | None = None
    why: str = ""

    @staticmethod
    def per_item(items: int, bytes_each: int, values_each: int, why: str, floor: int = 1 << 20,
                 ceiling: int = JSON_LIMIT) -> Budget:
        """``floor`` bytes plus ``bytes_each`` per item (at most ``ceiling``); 64 values plus ``values_each``
        per item."""
        return Budget(min(ceiling, floor + bytes_each * max(0, items)), 64 + values_each * max(0, items), why)


def value_count(data: bytes) -> int:
    """An upper bound on the values and members a JSON text parses into, counted in C."""
    return data.count(b",") + data.count(b"[") + data.count(b"{") + 1


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS} are accepted)")
    return int(text)


def _float(text: str) -> float:
    value = float(text) if len(text) <= 64 else math.inf
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:24]}{'...' if len(text) > 24 else ''}, which is not a finite float")
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"{text}, which is not a JSON number")


def _has_lone_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


def loads(raw: bytes | bytearray | str, source: str, fix: str, budget: Budget | None = None) -> Any:
    """Parse ``raw`` (the whole file, already read within its size limit) or raise one :class:`FormatError`.

    ``source`` names the file (or the file and field) and ``fix`` says what to do, for the message;
    ``budget``'s value limit is checked before parsing.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if budget is not None and budget.values is not None and (n := value_count(data)) > budget.values:
        raise FormatError(f"{source} holds up to {n:,} JSON values, more than the {budget.values:,} that "
                          f"{budget.why or 'such a file'} can need (parsing them would take memory the input does "
                          f"not back); {fix}")
    containers = data.count(b"[") + data.count(b"{")
    if containers > 16 + len(data) // BYTES_PER_CONTAINER:
        raise FormatError(f"{source} opens {containers} JSON arrays or objects in {len(data)} bytes, more than any "
                          f"genuine file (it would amplify memory); {fix}")
    try:
        text = data.decode("utf-8")
        obj = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except UnicodeDecodeError as e:
        raise FormatError(f"{source} is not UTF-8 text (byte {e.start}); {fix}") from None
    except _Refused as e:
        raise FormatError(f"{source} holds {e}; {fix}") from None
    except RecursionError:
        raise FormatError(f"{source} nests JSON too deeply; {fix}") from None
    except ValueError as e:  # JSONDecodeError and the rest
        raise FormatError(f"{source} is not valid JSON ({str(e)[:200]}); {fix}") from None
    if _ESCAPED_SURROGATE.search(data) and _has_lone_surrogate(obj):
        raise FormatError(f"{source} holds a string with a lone UTF-16 surrogate (\\ud800-\\udfff), which no "
                          f"name or value can contain; {fix}")
    return obj


def load_json_object(path: Path, what: str, limit: int = JSON_LIMIT, budget: Budget | None = None) -> dict[str, Any]:
    """A JSON file that must hold an object (metadata.json, the manifest, an index), within ``budget``
    (or ``limit`` bytes)."""
    fix = f"fix or remove {path.name}"
    raw = read_small_file(path, budget.limit if budget is not None else limit, what, fix)
    obj = loads(raw, str(path), fix, budget)
    if not isinstance(obj, dict):
        raise FormatError(f"{path} holds a JSON {type(obj).__name__}, expected an object; {fix}")
    return obj
