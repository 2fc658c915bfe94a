"""A MoE checkpoint's optimizer objects between megatron-core's two layouts: one optimizer, or the chained pair.

At EP 1 with expert TP = TP megatron-core keeps the experts in the dense buffers and builds one
``DistributedOptimizer`` (no ``chained_`` prefix); elsewhere a ``ChainedOptimizer`` of a dense (``chained_0.``)
and an expert one (``chained_1.``). A reshard from one layout to the other edits three byte objects on their
pickle *opcodes* (never unpickled, as :mod:`.megatron_dp_objects` does):

* ``common_state``'s ``'optimizer'`` part: ``{'param_state_sharding_type': T}`` for one optimizer,
  ``{0: {...}, 1: {...}}`` for the pair (what megatron-core's ``ChainedOptimizer.sharded_state_dict`` saves; its
  load merges it with the sharded part by that structure);
* each optimizer's ``param_groups`` (``optimizer.distributed.dp_group_idx_N.optimizer``): the dense optimizer's are
  the same bytes in both layouts (``chained_0.`` of ``pair_qwen2moe_ep2`` equals the one optimizer's of
  ``pair_qwen2moe_tp2_ep1``, opcode for opcode), so the one optimizer's serve as ``chained_0.``'s and
  ``chained_0.``'s as the one optimizer's. The expert optimizer's are the dense ones with
  ``is_expert_parallel`` true, and only the groups megatron-core makes for the experts: it makes a group per
  (``wd_mult``, ``lr_mult``, ...) that some parameter has, and an expert's weights decay (``wd_mult`` 1) while only
  biases and 1-D parameters do not (``wd_mult`` 0), so where the experts have no biases (SwiGLU experts) the
  dense no-decay group is left out, as megatron-core's own expert optimizer saves it (``pair_qwen2moe_ep2``'s
  ``chained_1.`` pickle, opcode for opcode; its loader would ignore the extra group, pairing saved and live groups
  by ``param_group_identifier_keys``).
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.copying.megatron_blobs import INT_OPS, PUT_OPS, blob_records, pickle_ops
from ckpt_tool.reshard.megatron_objects import COMMON, pickle_str
from gtp_format.errors import FormatError
from gtp_format.names import OPT_PREFIX
from gtp_format.writer.torch_blob import object_blob

CHAINED = ("chained_0." + OPT_PREFIX, "chained_1." + OPT_PREFIX)
_STR = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE")
_GET = ("BINGET", "LONG_BINGET", "GET")
_MARKED = ("SETITEMS", "APPENDS", "TUPLE", "LIST", "DICT", "POP_MARK", "OBJ", "INST", "ADDITEMS", "FROZENSET")
PST = "param_state_sharding_type"
EXPERT_FLAG = "is_expert_parallel"
SETITEM, SETITEMS, EMPTY_DICT, MARK, NEWTRUE = b"s", b"u", b"}", b"(", b"\x88"


def source_prefix(ckpt: Any, prefix: str) -> tuple[str, bool]:
    """(the source's optimizer prefix whose objects the target's ``prefix`` takes, whether its param groups are to
    be marked as the expert optimizer's)."""
    def has(p: str) -> bool:
        return f"{p}.dp_group_idx_0.optimizer/shard_0_1" in ckpt.entries

    if has(prefix):
        return prefix, False
    if prefix == OPT_PREFIX and has(CHAINED[0]):
        return CHAINED[0], False
    if prefix in CHAINED and has(OPT_PREFIX):
        return OPT_PREFIX, prefix == CHAINED[1]
    raise FormatError(f"{ckpt.root}: byte object {prefix}.dp_group_idx_0.optimizer is missing, and no optimizer of "
                      "the source stands for it; reshard of this checkpoint is not supported")


def _skip_put(ops: list[tuple[str, Any, bytes]], i: int) -> int:
    return i + 1 if i < len(ops) and ops[i][0] in PUT_OPS else i


def _refuse(root: str, why: str) -> FormatError:
    return FormatError(f"{root}: {COMMON}'s optimizer part {why}, not megatron-core's; reshard between one optimizer "
                       "and the chained pair of this common state is not supported")


def _optimizer_part(root: str, ops: list[tuple[str, Any, bytes]]) -> tuple[int, int, int, int, bool]:
    """(start, end) of the ops of ``common_state['optimizer']``'s value, (start, end) of its one-optimizer dict
    (``chained_0``'s where chained), and whether it is chained."""
    k = next((i for i, (n, a, _) in enumerate(ops) if n in _STR and a == PST), None)
    if k is None:
        raise _refuse(root, f"records no {PST}")
    j = k - 1 - (ops[k - 1][0] in PUT_OPS)
    if j >= 0 and ops[j][0] == "MARK":  # a batch of items: more than one field
        raise _refuse(root, f"holds more than {PST}")
    if j < 0 or ops[j][0] != "EMPTY_DICT":
        raise _refuse(root, "is not a dict")
    m = _skip_put(ops, k + 1)
    if m >= len(ops) or ops[m][0] not in _STR:
        raise _refuse(root, f"has a {PST} that is not a string")
    m = _skip_put(ops, m + 1)
    if m >= len(ops) or ops[m][0] != "SETITEM":
        raise _refuse(root, f"holds more than {PST}")
    inner = (j, m + 1)
    b = j - 1
    if b < 1 or ops[b][0] not in INT_OPS or ops[b][1] != 0 or ops[b - 1][0] != "MARK":
        return (*inner, *inner, False)
    c = b - 2 - (ops[b - 2][0] in PUT_OPS)
    if c < 0 or ops[c][0] != "EMPTY_DICT":
        raise _refuse(root, "is chained but not a dict")
    depth = 1
    for i in range(inner[1], len(ops)):
        depth += ops[i][0] == "MARK"
        depth -= ops[i][0] in _MARKED
        if depth == 0:
            if ops[i][0] != "SETITEMS":
                raise _refuse(root, "is chained but not a dict")
            return c, i + 1, *inner, True
    raise _refuse(root, "never ends")


def chain_common(root: str, blob: bytes, chained: bool) -> bytes:
    """``common_state`` with its optimizer part as ``chained`` asks (the blob as it is where it already is)."""
    prefix, records = blob_records(root, COMMON, blob)
    ops = pickle_ops(root, COMMON, dict(records)["data.pkl"])
    start, end, a, z, was = _optimizer_part(root, ops)
    if was == chained:
        return blob
    raw = [r for _, _, r in ops]
    if chained:  # {0: the one optimizer's dict, 1: a dict of the same sharding type}
        value = ops[_skip_put(ops, next(i for i in range(a, z) if ops[i][0] in _STR and ops[i][1] == PST) + 1)][1]
        new = (EMPTY_DICT + MARK + b"K\x00" + b"".join(raw[start:end]) + b"K\x01" + EMPTY_DICT + pickle_str(PST)
               + pickle_str(value) + SETITEM + SETITEMS)
    else:  # chained_0's dict alone: its memo entries are kept, the pair's are checked unused below
        gone = {ops[i][1] for i in (*range(start, a), *range(z, end)) if ops[i][0] in PUT_OPS}
        if any(n in _GET and arg in gone for n, arg, _ in ops[end:]):
            raise _refuse(root, "is referred to later in the pickle")
        new = b"".join(raw[a:z])
    pkl = b"".join(raw[:start]) + new + b"".join(raw[end:])
    return object_blob(prefix, [(n, pkl if n == "data.pkl" else d) for n, d in records])


def expert_groups(root: str, key: str, blob: bytes, no_decay: bool = True) -> bytes:
    """A dense optimizer's ``param_groups`` object with every group's ``is_expert_parallel`` set true: the
    expert optimizer's (see the module docstring); ``no_decay`` false (the experts have no bias): without the
    groups of ``wd_mult`` 0."""
    prefix, records = blob_records(root, key, blob)
    ops = pickle_ops(root, key, dict(records)["data.pkl"])
    if not no_decay:
        ops = _without_no_decay_groups(root, key, ops)
    raw = [r for _, _, r in ops]
    memo: set[Any] = set()
    flipped = 0
    for i, (name, arg, _) in enumerate(ops):
        if not ((name in _STR and arg == EXPERT_FLAG) or (name in _GET and arg in memo)):
            continue
        if name in _STR and i + 1 < len(ops) and ops[i + 1][0] in PUT_OPS:
            memo.add(ops[i + 1][1])
        v = _skip_put(ops, i + 1)
        if v >= len(ops) or ops[v][0] not in ("NEWTRUE", "NEWFALSE"):
            raise FormatError(f"{root}: byte object {key}'s {EXPERT_FLAG} is not a bool; reshard of these param "
                              "groups is not supported")
        raw[v] = NEWTRUE
        flipped += 1
    if not flipped:
        raise FormatError(f"{root}: byte object {key}'s param groups record no {EXPERT_FLAG}; megatron-core pairs "
                          "its groups by it; reshard of these param groups is not supported")
    return object_blob(prefix, [(n, b"".join(raw) if n == "data.pkl" else d) for n, d in records])


def _without_no_decay_groups(root: str, key: str, ops: list[tuple[str, Any, bytes]]) -> list[tuple[str, Any, bytes]]:
    """``ops`` without the param groups (dicts in the ``param_groups`` list) whose ``wd_mult`` is 0.0. Each group is
    one ``EMPTY_DICT [PUT] MARK ... SETITEMS`` run of the list's ``MARK ... APPENDS`` batch (one group left: ``...
    APPEND``, as the pickler writes it); a group whose memo entries a kept op refers to, or a list of another form,
    is refused, never guessed."""
    def refuse(why: str) -> FormatError:
        return FormatError(f"{root}: byte object {key}'s param_groups {why}; reshard of these param groups is not "
                           "supported")

    k = next((i for i, (n, a, _) in enumerate(ops) if n in _STR and a == "param_groups"), None)
    if k is None:
        raise refuse("are missing")
    i = _skip_put(ops, k + 1)
    if i >= len(ops) or ops[i][0] != "EMPTY_LIST":
        raise refuse("are not a list")
    i = _skip_put(ops, i + 1)
    if i >= len(ops) or ops[i][0] != "MARK":
        return ops  # one group (APPEND) or none: nothing to leave out
    groups: list[tuple[int, int]] = []
    j = i + 1
    while j < len(ops) and ops[j][0] != "APPENDS":
        start = j
        m = _skip_put(ops, j + 1)
        if ops[j][0] != "EMPTY_DICT" or m >= len(ops) or ops[m][0] != "MARK":
            raise refuse("hold something other than dicts of several items")
        depth, j = 1, m + 1
        while j < len(ops) and depth:
            depth += ops[j][0] == "MARK"
            depth -= ops[j][0] in _MARKED
            j += 1
        if depth or ops[j - 1][0] != "SETITEMS":
            raise refuse("hold a group that never ends")
        groups.append((start, j))
    if j >= len(ops):
        raise refuse("never end")
    memo = {ops[q + 1][1]: arg for q, (n, arg, _) in enumerate(ops[:-1]) if n in _STR and ops[q + 1][0] in PUT_OPS}
    drop: list[tuple[int, int]] = []
    for a, z in groups:
        wd = next((ops[_skip_put(ops, q + 1)] for q in range(a, z) if (ops[q][0] in _STR and ops[q][1] == "wd_mult")
                   or (ops[q][0] in _GET and memo.get(ops[q][1]) == "wd_mult")), None)
        if wd is None or wd[0] != "BINFLOAT":
            raise refuse("record no float wd_mult")
        if wd[1] == 0.0:
            drop.append((a, z))
    if not drop or len(drop) == len(groups):
        return ops
    gone = {ops[q][1] for a, z in drop for q in range(a, z) if ops[q][0] in PUT_OPS}
    one = len(groups) - len(drop) == 1  # pickle writes a one-item list as ``item APPEND``, not a marked batch
    kept = [("APPEND", None, b"a") if one and q == j else op for q, op in enumerate(ops)
            if not any(a <= q < z for a, z in drop) and not (one and q == i)]
    if any(n in _GET and arg in gone for n, arg, _ in kept):
        raise refuse("share memo entries between groups")
    return kept
