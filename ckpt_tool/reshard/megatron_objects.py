"""The byte objects of a megatron-core ``fully_reshardable`` checkpoint, taken from a ``dp_reshardable`` one.

megatron-core's own ``fully_reshardable`` save holds, besides the tensors, ``common_state`` (args,
iteration, the optimizer's non-sharded part, the scheduler, ``content_metadata``), one
``<module>._extra_state/shard_<layer>_<layers>`` per layer of every linear layer, and one
``rng_state`` per (pp, tp). The export writes them as follows, never unpickling any of them:

* ``_extra_state``: copied as the bytes they are (identical in both formats: the same module's
  ``[None]`` with the local spec, Transformer Engine's fp8 metadata otherwise).
* ``common_state``: the source's blob with two edits made on its pickle *opcodes*
  (:mod:`pickletools` decodes them without running anything): every string equal to the source's
  sharding type becomes ``fully_reshardable`` (``optimizer.param_state_sharding_type`` and
  ``content_metadata.distrib_optim_sharding_type``: megatron-core's loader takes the sharding
  type from the checkpoint's common state, not from the caller), and the inner optimizer's
  ``param_groups`` (lr, betas, ``step``), which ``dp_reshardable`` stores in the byte object
  ``optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1``, are spliced in as
  ``optimizer.optimizer``, where megatron-core's ``fully_reshardable`` save keeps them (it writes
  rank 0's, whose model-parallel index is 0; its loader asserts one ``step`` across them).
  ``content_metadata`` also gets megatron's ``distrib_optim_fully_reshardable_mem_efficient:
  False`` (the save it stands for gathers on DP rank 0). ``args`` are left as they are
  (``dist_ckpt_optim_fully_reshardable`` still says False: megatron's loader reads the format
  from ``content_metadata``).
* ``rng_state``: dropped. It is per (pp, tp) of the *source* topology, and a load at another
  one (the point of this format) cannot use it; megatron-core loads without it when told
  ``--no-load-rng``, which a topology change needs anyway.

A common state of another structure (a protocol other than torch.save's 2,
persistent ids) is refused in one line.
"""

from __future__ import annotations

import struct
from typing import Any

from ckpt_tool.copying.megatron_blobs import blob_records, pickle_ops
from gtp_format.errors import FormatError
from gtp_format.reader.checkpoint import Checkpoint
from gtp_format.reader.chunks import chunk_bytes
from gtp_format.writer.torch_blob import object_blob

COMMON = "common_state/shard_0_1"
TARGET = "fully_reshardable"
MEM_EFFICIENT = "distrib_optim_fully_reshardable_mem_efficient"
_PUT = ("BINPUT", "LONG_BINPUT")
_GET = ("BINGET", "LONG_BINGET")
_STR = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")
_INT = ("BININT", "BININT1", "BININT2")


def _memo_op(name: str, index: int) -> bytes:
    return (b"r" if name in _PUT else b"j") + struct.pack("<I", index)  # LONG_BINPUT / LONG_BINGET


def _param_groups(root: str, key: str, pkl: bytes, base: int) -> bytes:
    """The opcodes of the one object in ``[obj]`` (ShardedObject's wrapper), memo renumbered from ``base``."""
    ops = pickle_ops(root, key, pkl)
    names = [n for n, _, _ in ops]
    first_key = next((a for n, a, _ in ops[4:] if n in _STR), None)
    if (names[1] != "EMPTY_LIST" or names[2] not in _PUT or names[3] != "EMPTY_DICT"
            or names[-2:] != ["APPEND", "STOP"] or first_key != "param_groups"):
        raise FormatError(f"{root}: byte object {key} is not a one-element list of {{'param_groups': ...}}; export "
                          "of this optimizer state is not supported")
    return b"".join(_memo_op(n, base + a) if n in _PUT + _GET else raw for n, a, raw in ops[3:-2])


def fully_reshardable_common(root: str, common: bytes, optimizers: list[bytes], source_type: str) -> bytes:
    """``common_state``'s blob for ``fully_reshardable`` from a ``dp_reshardable`` one and its optimizer
    objects: one, or one per chained optimizer (MoE: dense, expert), whose common part megatron-core
    keeps as ``'optimizer': {0: {...}, 1: {...}}``."""
    prefix, records = blob_records(root, COMMON, common)
    pkl = dict(records)["data.pkl"]
    ops = pickle_ops(root, COMMON, pkl)
    base = 1 + max((a for n, a, _ in ops if n in _PUT), default=0)
    groups = []
    for i, optimizer in enumerate(optimizers):
        _, opt_records = blob_records(root, "optimizer", optimizer)
        opt_pkl = dict(opt_records)["data.pkl"]
        groups.append(_param_groups(root, f"optimizer {i}'s param_groups", opt_pkl, base))
        base += 1 + max((a for n, a, _ in pickle_ops(root, "optimizer", opt_pkl) if n in _PUT), default=0)
    chained = len(optimizers) > 1
    strings = {ops[j + 1][1]: a for j, (n, a, _) in enumerate(ops[:-1]) if n in _STR and ops[j + 1][0] in _PUT}

    def names(j: int, text: str) -> bool:  # opcode j pushes the string ``text`` (or its memo entry)
        n, a, _ = ops[j]
        return (n in _STR and a == text) or (n in _GET and strings.get(a) == text)

    out, spliced = [], 0
    flag = _flag_after(ops)
    for i, (name, arg, raw) in enumerate(ops):
        out.append(pickle_str(TARGET) if name in _STR and arg == source_type else raw)
        if i == flag:  # megatron's fully_reshardable save records the (default) memory-efficiency flag too
            out.append(pickle_str(MEM_EFFICIENT) + b"\x89")  # NEWFALSE
        # `'optimizer': {}` (the string, its memo put, the dict, its memo put), or a chained optimizer's
        # `<i>: {}` followed by its `param_state_sharding_type`: fill the new dict first
        if name not in _PUT or i < 3 or ops[i - 1][0] != "EMPTY_DICT":
            continue
        if not chained and ops[i - 3][0] in _STR and ops[i - 3][1] == "optimizer":
            index = 0
        elif chained and ops[i - 2][0] in _INT and i + 1 < len(ops) and names(i + 1, "param_state_sharding_type"):
            index = ops[i - 2][1]
        else:
            continue
        if not 0 <= index < len(groups):
            raise FormatError(f"{root}: {COMMON} names optimizer {index} of {len(groups)}; export of this common "
                              "state is not supported")
        out.append(pickle_str("optimizer") + groups[index] + b"s")  # SETITEM: value['optimizer'] = {param_groups}
        spliced += 1
    if spliced != len(groups) or not any(n in _STR and a == source_type for n, a, _ in ops):
        raise FormatError(f"{root}: {COMMON} has {spliced} optimizer entries of the expected form (one "
                          f"{{'param_state_sharding_type': {source_type!r}}} dict per optimizer, {len(groups)} "
                          "optimizers); export of this common state is not supported")
    return object_blob(prefix, [(n, b"".join(out) if n == "data.pkl" else d) for n, d in records])


def _flag_after(ops: list[tuple[str, Any, bytes]]) -> int | None:
    """The opcode after which ``content_metadata`` gets ``MEM_EFFICIENT: False``: the end of the
    ``distrib_optim_sharding_type`` value, when that key opens a ``MARK ... SETITEMS`` batch (so a
    pair more is just two more items) and the flag is not there yet."""
    if any(n in _STR and a == MEM_EFFICIENT for n, a, _ in ops):
        return None
    for j, (n, a, _) in enumerate(ops):
        if n in _STR and a == "distrib_optim_sharding_type" and j > 0 and ops[j - 1][0] == "MARK":
            k = j + (2 if j + 1 < len(ops) and ops[j + 1][0] in _PUT else 1)  # the value
            if k < len(ops) and ops[k][0] in _STR + _GET:
                return k + (1 if ops[k][0] in _STR and k + 1 < len(ops) and ops[k + 1][0] in _PUT else 0)
    return None


def pickle_str(s: str) -> bytes:
    """``s`` as the pickle opcode that pushes it (``BINUNICODE``)."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def extra_objects(ckpt: Checkpoint, max_bytes: int) -> dict[str, bytes]:
    """Every byte object of the export, by key: ``_extra_state`` as stored (after its zip records
    pass their CRC-32: a damaged source is refused, not copied), ``common_state`` rewritten. They
    are held in memory together, so more than ``max_bytes`` of them (the export's chunk budget;
    megatron-core's are a few KiB each) is refused in one line."""
    root = str(ckpt.root)
    wanted = [(k, e) for k, e in ckpt.entries.items() if e.kind == "bytes" and e.chunks
              and ("._extra_state/" in k or k == COMMON or k.endswith(".optimizer/shard_0_1"))]
    total = sum(e.chunks[0].storage.length for _, e in wanted if e.chunks[0].storage is not None)
    if total > max_bytes:
        raise FormatError(f"{root}: its byte objects (common_state, _extra_state) declare {total} bytes, more than "
                          f"the {max_bytes}-byte chunk budget; raise --max-memory")
    out: dict[str, bytes] = {}
    for key, e in wanted:
        if "._extra_state/" in key:
            blob = bytes(chunk_bytes(ckpt, e, e.chunks[0]))
            blob_records(root, key, blob)
            out[key] = blob
    common = ckpt.entries.get(COMMON)
    first = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"
    chained = sorted({k.split(".", 1)[0] for k in ckpt.entries if k.startswith("chained_")},
                     key=lambda p: int(p[len("chained_"):]) if p[len("chained_"):].isdigit() else -1)
    firsts = [f"{c}.{first}" for c in chained] if chained else [first]
    if common is not None:
        missing = [k for k in firsts if k not in ckpt.entries or ckpt.entries[k].kind != "bytes"]
        if missing or (chained and chained != [f"chained_{i}" for i in range(len(chained))]):
            raise FormatError(f"{root}: {COMMON} is there but {(missing or firsts)[0]} (the optimizer's param_groups) "
                              "is not; export of this common state is not supported")
        blobs = [bytes(chunk_bytes(ckpt, ckpt.entries[k], ckpt.entries[k].chunks[0])) for k in firsts]
        out[COMMON] = fully_reshardable_common(root, bytes(chunk_bytes(ckpt, common, common.chunks[0])), blobs,
                                               "dp_reshardable")
    return out
