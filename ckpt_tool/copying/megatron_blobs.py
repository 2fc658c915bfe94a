"""A torch.save blob's records and its pickle's opcodes, read without running anything, and the
``per_bucket_numel`` object of megatron-core's distributed optimizer written anew for a target's buffers.

Shared by the megatron-core writers of ``ckpt reshard`` (:mod:`ckpt_tool.reshard.megatron_dp_objects`,
:mod:`ckpt_tool.reshard.megatron_objects`) and ``ckpt import --to megatron-core``
(:mod:`ckpt_tool.hf.megatron_dp_import`), so it lives in the copy kernel below both. :mod:`pickletools`
decodes the opcodes; nothing is unpickled.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.reader.zip_blob import BlobError, ViewReader, small_record, zip_records
from gtp_format.writer.torch_blob import object_blob

PUT_OPS = ("BINPUT", "LONG_BINPUT")
INT_OPS = ("BININT", "BININT1", "BININT2", "LONG1")
_REFUSED = ("MEMOIZE", "FRAME", "PERSID", "BINPERSID", "PROTO")


def pickle_int(v: int) -> bytes:
    """The shortest opcode torch.save's pickler writes for the int ``v``."""
    if 0 <= v < 256:
        return b"K" + bytes((v,))
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(1 << 31) <= v < (1 << 31):
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes((len(raw),)) + raw


def blob_records(root: str, key: str, blob: bytes) -> tuple[str, list[tuple[str, bytes]]]:
    """(prefix, [(name, bytes)]) of a torch.save blob's records, CRC-checked, in stored order."""
    reader = ViewReader(memoryview(blob))
    try:
        recs = sorted(zip_records(reader).values(), key=lambda r: r.header_offset)
        out = [(r.name, small_record(reader, r)) for r in recs]
    except BlobError as e:
        raise FormatError(f"{root}: byte object {key} is not an intact torch.save blob ({e}); run `ckpt verify "
                          "--data` on it") from None
    pkl = [n for n, _ in out if n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise FormatError(f"{root}: byte object {key} has no data.pkl record; it is not a torch.save blob")
    prefix = pkl[0][: -len("data.pkl")]
    return prefix, [(n[len(prefix):], data) for n, data in out]


def pickle_ops(root: str, key: str, pkl: bytes) -> list[tuple[str, Any, bytes]]:
    """(opcode name, argument, raw bytes) of every opcode, decoded without being run."""
    try:
        decoded = list(pickletools.genops(pkl))
    except (ValueError, struct.error) as e:
        raise FormatError(f"{root}: byte object {key}'s pickle does not decode ({e})") from None
    ends = [pos for _, _, pos in decoded[1:]] + [len(pkl)]
    out = [(op.name, arg, pkl[pos:end]) for (op, arg, pos), end in zip(decoded, ends)]
    if not out or out[0][0] != "PROTO" or out[0][1] != 2:
        raise FormatError(f"{root}: byte object {key} is not a protocol-2 pickle as torch.save writes it; "
                          "export of this common state is not supported")
    if any(name in _REFUSED for name, _, _ in out[1:]):
        raise FormatError(f"{root}: byte object {key} holds opcodes torch.save's object pickles do not "
                          "(memo frames or persistent ids); export of this common state is not supported")
    return out


_DTYPES = ("bfloat16", "float16", "float32", "float64", "uint8")  # megatron-core's buffer dtypes (uint8: fp8 storage)


def _dtype_global(root: str, key: str, name: str) -> bytes:
    """The pickle GLOBAL of ``torch.<name>`` (``torch.bfloat16`` from a key tag), as torch.save writes a dtype."""
    bare = name.removeprefix("torch.")
    if bare not in _DTYPES:
        raise FormatError(f"{root}: {key}: buffer dtype {name!r} is not one megatron-core keeps a buffer in")
    return b"ctorch\n" + bare.encode() + b"\n"


def numel_blob(root: str, key: str, blob: bytes, buffers: list[tuple[str, list[int]]]) -> bytes:
    """``blob`` (a ``[[{dtypes: [n, ...]}, ...]]`` object) with its pickle written anew for ``buffers``.

    ``buffers``: per gbuf, its key tag ``(torch.bfloat16, torch.float32)`` and bucket numels. Written
    anew, not edited, because a target stage can hold the source's buffers in another order (a stage
    that starts with an fp32 layernorm has its fp32 buffer first). The source must be such an object
    (dtype GLOBALs, ints, lists, dicts: nothing else), so its other records are kept as they are.
    """
    prefix, records = blob_records(root, key, blob)
    ops = pickle_ops(root, key, dict(records)["data.pkl"])
    allowed = {"PROTO", "EMPTY_LIST", "EMPTY_DICT", "MARK", "TUPLE2", "APPEND", "APPENDS", "SETITEM", "SETITEMS",
               "STOP", "GLOBAL", *PUT_OPS, "BINGET", "LONG_BINGET", *INT_OPS}
    bad = next((n for n, a, _ in ops if n not in allowed or (n == "GLOBAL" and not str(a).startswith("torch "))), None)
    if bad is not None or len(ops) < 3 or ops[1][0] != "EMPTY_LIST":
        raise FormatError(f"{root}: byte object {key} is not a list of {{(param dtype, grad dtype): [numel, ...]}} "
                          f"per gbuf ({bad or 'another structure'}); reshard of this optimizer state is not supported")
    body = b""
    for dtag, numels in buffers:
        names = [d.strip() for d in dtag.strip("()").split(",")]
        if len(names) != 2:
            raise FormatError(f"{root}: {key}: buffer tag {dtag!r} is not (param dtype, grad dtype)")
        body += (b"}" + _dtype_global(root, key, names[0]) + _dtype_global(root, key, names[1]) + b"\x86]("
                 + b"".join(pickle_int(n) for n in numels) + b"es")  # {(pd, gd): [n, ...]}
    new = b"\x80\x02]](" + body + b"ea."  # [[buffer, ...]]
    return object_blob(prefix, [(n, new if n == "data.pkl" else d) for n, d in records])
