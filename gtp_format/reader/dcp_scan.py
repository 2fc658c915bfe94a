"""Scan a DCP ``.metadata`` pickle straight into columns: no Python object per chunk.

Why: the C unpickler builds every object the pickle describes and keeps each one in its memo until
the load ends, so a 1M-chunk file (139 MB) became 1.3 GB of records before the model was built
(``benchmarks/meta_stages.py`` on the 2-core machine), most of ``inspect``'s peak memory and a third
of its time. :func:`scan` runs the pickle machine over the bytes in one compiled loop (numba), with
a stack and memo of typed *handles* instead of objects: a string is its place in the bytes, an int
its value, a ``torch.Size`` a slice of one array of dims, a record a row of its class's columns.
What comes out is a few numpy arrays (per chunk: offsets, sizes, the list it is in; per storage
entry: the key's name, offsets, file name, byte range; per key: properties, size, chunk list).

It is a fast path, never a second judge. It accepts only the pickles DCP writes for its own classes
(protocol 4 or 5 opcodes, the allow-listed globals it knows, records built the way ``pickle`` builds
dataclasses, no memo copy of anything mutable, ASCII strings) and gives up (a non-zero status) at
the first thing it does not take; the caller then reads the file the old way (both pre-walks, the
C unpickler, the inert records), which accepts or refuses it with the same words as ever. What it
accepts, the old way accepts too, with the same records: it counts containers exactly as
``pickle_shape.check_shape`` does and refuses past the same limit, nests no deeper than DCP's 9
levels, copies no memo entry that is not there, and never assigns to a global, so it needs neither
pre-walk; tests/format/test_dcp_scan.py checks the model it leads to against the old one on
genuine, mutated and hostile pickles.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import numpy as np

from gtp_format.dtypes import DTYPES
from gtp_format.reader.allow_list import ALLOWED, DCP_FS, DCP_META, Kind

# value tags (the typed stack and memo)
T_NONE, T_BOOL, T_INT, T_STR, T_GLOBAL, T_TINT, T_TSTR, T_T1TINT, T_SIZE, T_LAYOUT, T_MEMFMT, T_PROPSTATE, \
    T_OBJ, T_DICT, T_LIST, T_PATH, T_TATOM = range(17)

# globals (codes >= G_DTYPE: a dtype, code - G_DTYPE its index in DTYPE_NAMES)
C_METADATA, C_TSM, C_BSM, C_CHUNK, C_PROPS, C_MDINDEX, C_SINFO, C_SMETA, C_PLAN, G_SIZE, G_LAYOUT, G_MEMFMT, \
    G_POSIX = range(1, 14)
G_DTYPE = 100
DTYPE_NAMES = tuple(DTYPES)
_CLASSES = {"Metadata": C_METADATA, "TensorStorageMetadata": C_TSM, "BytesStorageMetadata": C_BSM,
            "ChunkStorageMetadata": C_CHUNK, "TensorProperties": C_PROPS, "MetadataIndex": C_MDINDEX,
            "StorageMeta": C_SMETA}

# Megatron's ``all_local_plans`` (every rank's SavePlan, kept for loading): records the model never reads,
# taken with any fields of the values below; their chunks and properties are memo copies of the key's own
_PLAN_CLASSES = frozenset({"SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData", "_StoragePrefix"})

# fields: (class, name) -> code
F_OFFSETS, F_SIZES, F_FQN, F_MOFFSET, F_INDEX, F_RELPATH, F_SOFFSET, F_LENGTH, F_TRANSFORMS, F_PROPERTIES, \
    F_SIZE, F_CHUNKS, F_SDM, F_PLANNER, F_SD, F_SMETA, F_VERSION, F_PLANS, F_CKPTID, F_SAVEID, F_LOADID, \
    F_MODULES = range(1, 23)
_FIELDS = {
    (C_CHUNK, "offsets"): F_OFFSETS, (C_CHUNK, "sizes"): F_SIZES,
    (C_MDINDEX, "fqn"): F_FQN, (C_MDINDEX, "offset"): F_MOFFSET, (C_MDINDEX, "index"): F_INDEX,
    (C_SINFO, "relative_path"): F_RELPATH, (C_SINFO, "offset"): F_SOFFSET, (C_SINFO, "length"): F_LENGTH,
    (C_SINFO, "transform_descriptors"): F_TRANSFORMS,
    (C_TSM, "properties"): F_PROPERTIES, (C_TSM, "size"): F_SIZE, (C_TSM, "chunks"): F_CHUNKS,
    (C_METADATA, "state_dict_metadata"): F_SDM, (C_METADATA, "planner_data"): F_PLANNER,
    (C_METADATA, "storage_data"): F_SD, (C_METADATA, "storage_meta"): F_SMETA, (C_METADATA, "version"): F_VERSION,
    (C_METADATA, "all_local_plans"): F_PLANS,
    (C_SMETA, "checkpoint_id"): F_CKPTID, (C_SMETA, "save_id"): F_SAVEID, (C_SMETA, "load_id"): F_LOADID,
    (C_SMETA, "modules"): F_MODULES,
}
# dict roles
D_EMPTY, D_STATE, D_SDM, D_SD, D_OPAQUE = range(5)
# list roles
L_EMPTY, L_CHUNKS, L_OPAQUE = range(3)

MAX_STACK = 1 << 14  # genuine: a SETITEMS batch of 1,000 pairs and a few levels
MAX_MARKS = 64
MAX_DIMS = 64  # as allow_list.MAX_DIMS
MAX_PATH = 4096  # as allow_list.MAX_PATH


def _global_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The allow-listed globals this scan takes: ``module\\0name`` bytes, their offsets and codes."""
    names, codes = [], []
    for (module, name), entry in ALLOWED.items():
        code = None
        if entry.kind is Kind.CLASS and entry.module == DCP_META and entry.name in _CLASSES:
            code = _CLASSES[entry.name]
        elif entry.kind is Kind.CLASS and (entry.module, entry.name) == (DCP_FS, "_StorageInfo"):
            code = C_SINFO
        elif entry.kind is Kind.CLASS and entry.name in _PLAN_CLASSES:
            code = C_PLAN
        elif entry.kind is Kind.ENUM:  # _MEM_FORMAT_ENCODING, WriteItemType: called with their value
            code = G_MEMFMT
        elif entry.kind is Kind.SIZE:
            code = G_SIZE
        elif entry.kind is Kind.GET_LAYOUT:
            code = G_LAYOUT
        elif entry.kind is Kind.POSIX_PATH:
            code = G_POSIX
        elif entry.kind is Kind.DTYPE:
            code = G_DTYPE + DTYPE_NAMES.index(entry.name)
        if code is not None:
            names.append(f"{module}\0{name}".encode())
            codes.append(code)
    return _packed(names) + (np.array(codes, np.int64),)


def _packed(names: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(names) + 1, np.int64)
    offsets[1:] = np.cumsum([len(n) for n in names])
    return np.frombuffer(b"".join(names), np.uint8).copy(), offsets


def _field_table() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    names = [n.encode() for (_, n) in _FIELDS]
    return _packed(names) + (np.array([c for (c, _) in _FIELDS], np.int64), np.array(list(_FIELDS.values()), np.int64))


GTAB, GOFF, GCODE = _global_table()
FTAB, FOFF, FCLASS, FCODE = _field_table()
LAYOUT_STRIDED = np.frombuffer(b"torch.strided", np.uint8).copy()


class Columns(NamedTuple):
    """What :func:`scan` found, trimmed to what was used. Dims live in ``dims``; a start of -1 is ``None``."""

    dims: np.ndarray
    chunk: np.ndarray  # [rows, 6]: offsets start, offsets ndim, sizes start, sizes ndim, fields set, list id
    mdindex: np.ndarray  # [rows, 6]: fqn pos, fqn len, offset start (-1: None), offset ndim, fields set, -
    sinfo: np.ndarray  # [rows, 6]: path pos, path len, offset, length, fields set, -
    tsm: np.ndarray  # [rows, 6]: props row, size start, size ndim, chunks list id, fields set, -
    props: np.ndarray  # [rows]: dtype index (-1: not built)
    lists: np.ndarray  # [lists, 3]: role, first row, count
    sdm: np.ndarray  # [rows, 5]: dict id, key pos, key len, class code, row
    sd: np.ndarray  # [rows, 3]: dict id, mdindex row, sinfo row
    meta: np.ndarray  # [7]: fields set, sdm dict id, storage_data dict id (-1: None), version pos, version len,
    #                    dicts made, memo entries


def scan(data: bytes | bytearray | memoryview) -> Columns | int:
    """The columns of a DCP metadata pickle, or a positive int (the byte where the scan gave up) for the
    caller to read it the old way. Needs numba (the caller checks :func:`available`)."""
    buf = np.frombuffer(data, np.uint8)
    out = _compiled()(buf, GTAB, GOFF, GCODE, FTAB, FOFF, FCLASS, FCODE, LAYOUT_STRIDED, 16 + len(buf) // 4)
    status = int(out[0])
    if status != 0:
        return status
    return Columns(*out[1:])


def available() -> bool:
    return _compiled() is not None


def compiled() -> bool:
    """Whether the scan's three loops are compiled for this machine already (numba's disk cache): if not, the
    first call compiles them, 14-18 s."""
    from gtp_format.reader.jit import compiled_on_disk

    return all(compiled_on_disk(f) for f in (_compiled(), compiled_join(), compiled_intern()))


@cache
def _compiled() -> Any:
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    from gtp_format.reader.jit import njit_cached

    return njit_cached(run, nogil=True)


def run(data: np.ndarray, gtab: np.ndarray,
        goff: np.ndarray, gcode: np.ndarray, ftab: np.ndarray, foff: np.ndarray, fclass: np.ndarray,
        fcode: np.ndarray, strided: np.ndarray, limit: int) -> Any:
    """The loop (numba compiles it; tests also run it as Python). Returns ``(status, *columns)``."""
    n = data.size
    memo_cap = obj_cap = list_cap = dict_cap = 1  # upper bounds: how often each one's opcode byte occurs
    for i in range(n):
        b = data[i]
        if b == 0x94:
            memo_cap += 1
        elif b == 0x81:
            obj_cap += 1
        elif b == 0x5D:
            list_cap += 1
        elif b == 0x7D:
            dict_cap += 1
    st = np.zeros(MAX_STACK, np.int8)  # tag, a, b, c per stack item
    sa = np.zeros(MAX_STACK, np.int64)
    sb = np.zeros(MAX_STACK, np.int64)
    sc = np.zeros(MAX_STACK, np.int64)
    marks = np.zeros(MAX_MARKS, np.int64)
    mt = np.empty(memo_cap, np.int8)  # memo: tag, a, b (a memo copy of T_TSTR/T_TATOM gives up: no c)
    ma = np.empty(memo_cap, np.int64)
    mb = np.empty(memo_cap, np.int32)
    dims = np.empty(n // 2 + 8, np.int64)  # each dim costs at least two bytes (BININT1)
    chunk = np.empty((obj_cap, 6), np.int64)
    mdx = np.empty((obj_cap, 6), np.int64)
    sinfo = np.empty((obj_cap, 6), np.int64)
    tsm = np.empty((obj_cap, 6), np.int64)
    props = np.empty(obj_cap, np.int64)
    cbuilt = np.empty(obj_cap, np.int8)
    mbuilt = np.empty(obj_cap, np.int8)
    sbuilt = np.empty(obj_cap, np.int8)
    tbuilt = np.empty(obj_cap, np.int8)
    pbuilt = np.empty(obj_cap, np.int8)
    lists = np.empty((list_cap, 3), np.int64)
    dicts = np.empty((dict_cap, 4), np.int64)  # role, owner class, owner row, -
    sdm = np.empty((obj_cap, 5), np.int64)
    sd = np.empty((obj_cap, 3), np.int64)
    meta = np.zeros(7, np.int64)
    meta[2] = -1
    meta[3] = -1
    rows = np.zeros(16, np.int64)  # rows made per class code (and sdm = 14, sd = 15)
    nd = 0  # dims used
    nl = 0  # lists made
    ndict = 0
    sp = 0
    mp = 0
    ml = 0
    count = 0  # containers, as pickle_shape counts them
    pos = 0
    smeta_built = 0
    md_made = 0
    md_built = 0
    status = 0
    while True:
        if pos >= n:
            status = n + 1
            break
        if sp + 4 >= MAX_STACK:
            status = pos + 1
            break
        op = data[pos]
        at = pos
        pos += 1
        if op == 0x94:  # MEMOIZE
            if sp == 0 or ml >= memo_cap:
                status = at + 1
                break
            mt[ml] = st[sp - 1]
            ma[ml] = sa[sp - 1]
            mb[ml] = sb[sp - 1]
            ml += 1
            continue
        if op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
            w = 1 if op == 0x68 else 4  # the memo index: 1 or 4 bytes, little-endian
            if pos + w > n:
                status = at + 1
                break
            idx = np.int64(0)
            for k in range(w):
                idx |= np.int64(data[pos + k]) << (8 * k)
            pos += w
            if idx >= ml:
                status = at + 1
                break
            tag = mt[idx]
            if tag == T_OBJ and ((ma[idx] == C_PROPS and props[mb[idx]] >= 0)
                                 or (ma[idx] == C_CHUNK and cbuilt[mb[idx]] == 1)):
                pass  # TensorProperties shared by keys, a chunk named again in a plan: built, they never change
            elif tag == T_OBJ or tag == T_DICT or tag == T_LIST or tag == T_TSTR or tag == T_TATOM \
                    or tag == T_PROPSTATE:
                status = at + 1  # a shared mutable object, or one whose handle the memo does not keep
                break
            st[sp] = tag
            sa[sp] = ma[idx]
            sb[sp] = mb[idx]
            sc[sp] = 0
            sp += 1
            continue
        if op == 0x4B or op == 0x4D or op == 0x4A or op == 0x8A:  # BININT1, BININT2, BININT, LONG1
            if op == 0x4B:
                w = 1
            elif op == 0x4D:
                w = 2
            elif op == 0x4A:
                w = 4
            else:
                if pos + 1 > n:
                    status = at + 1
                    break
                w = np.int64(data[pos])
                pos += 1
                if w > 8:
                    status = at + 1
                    break
            if pos + w > n:
                status = at + 1
                break
            v = np.int64(0)
            for k in range(w):
                v |= np.int64(data[pos + k]) << (8 * k)
            if w > 0 and (op == 0x4A or op == 0x8A) and data[pos + w - 1] >= 0x80:
                if w == 8:
                    if op == 0x8A:
                        status = at + 1  # a negative int: no DCP field takes one
                        break
                else:
                    v -= np.int64(1) << (8 * w)
            pos += w
            st[sp] = T_INT
            sa[sp] = v
            sb[sp] = 0
            sp += 1
            continue
        if op == 0x8C or op == 0x58:  # SHORT_BINUNICODE, BINUNICODE
            w = 1 if op == 0x8C else 4  # the length: 1 or 4 bytes, little-endian
            if pos + w > n:
                status = at + 1
                break
            ln = np.int64(0)
            for k in range(w):
                ln |= np.int64(data[pos + k]) << (8 * k)
            pos += w
            if pos + ln > n:
                status = at + 1
                break
            ascii_ok = True
            for k in range(pos, pos + ln):
                if data[k] >= 0x80:
                    ascii_ok = False
                    break
            if not ascii_ok:
                status = at + 1
                break
            st[sp] = T_STR
            sa[sp] = pos
            sb[sp] = ln
            sp += 1
            pos += ln
            continue
        if op == 0x28:  # MARK
            if mp >= MAX_MARKS:
                status = at + 1
                break
            marks[mp] = sp
            mp += 1
            continue
        if op == 0x4E or op == 0x88 or op == 0x89:  # NONE, NEWTRUE, NEWFALSE
            st[sp] = T_NONE if op == 0x4E else T_BOOL
            sa[sp] = 1 if op == 0x88 else 0
            sb[sp] = 0
            sp += 1
            continue
        if op == 0x80:  # PROTO
            if pos + 1 > n or data[pos] < 2 or data[pos] > 5:
                status = at + 1
                break
            pos += 1
            continue
        if op == 0x95:  # FRAME: its length must lie within the data (the C unpickler reads it whole)
            if pos + 8 > n:
                status = at + 1
                break
            ln = np.int64(0)
            for k in range(8):
                if k >= 4 and data[pos + k] != 0:
                    ln = np.int64(-1)
                    break
                ln |= np.int64(data[pos + k]) << (8 * k)
            pos += 8
            if ln < 0 or pos + ln > n:
                status = at + 1
                break
            continue
        if op == 0x2E:  # STOP
            if sp != 1 or mp != 0 or st[0] != T_OBJ or sa[0] != C_METADATA or md_built == 0:
                status = at + 1
            break
        # -- the rest make containers ------------------------------------------------------------
        if op == 0x29 or op == 0x7D or op == 0x5D:  # EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST
            count += 1
            if op == 0x29:
                st[sp] = T_TINT
                sa[sp] = nd
                sb[sp] = 0
            elif op == 0x7D:
                if ndict >= dict_cap:
                    status = at + 1
                    break
                dicts[ndict, 0] = D_EMPTY
                dicts[ndict, 1] = 0
                dicts[ndict, 2] = -1
                dicts[ndict, 3] = 0
                st[sp] = T_DICT
                sa[sp] = ndict
                ndict += 1
            else:
                if nl >= list_cap:
                    status = at + 1
                    break
                lists[nl, 0] = L_EMPTY
                lists[nl, 1] = -1
                lists[nl, 2] = 0
                st[sp] = T_LIST
                sa[sp] = nl
                nl += 1
            sb[sp] = 0
            sc[sp] = 0
            sp += 1
        elif op == 0x85 or op == 0x86 or op == 0x87 or op == 0x74:  # TUPLE1..3, TUPLE
            count += 1
            if op == 0x74:
                if mp == 0:
                    status = at + 1
                    break
                mp -= 1
                lo = marks[mp]
            else:
                lo = sp - (op - 0x84)
                if lo < 0:
                    status = at + 1
                    break
            k = sp - lo
            all_int = True
            all_str = True
            all_atom = True
            total = np.int64(0)
            for j in range(lo, sp):
                t = st[j]
                if t != T_INT:
                    all_int = False
                if t != T_STR:
                    all_str = False
                else:
                    total += sb[j]
                if t != T_INT and t != T_STR and t != T_NONE and t != T_BOOL:
                    all_atom = False
            if all_int:
                if k > MAX_DIMS or nd + k > dims.size:
                    status = at + 1
                    break
                for j in range(k):
                    dims[nd + j] = sa[lo + j]
                st[lo] = T_TINT
                sa[lo] = nd
                sb[lo] = k
                nd += k
            elif k == 1 and st[lo] == T_TINT:
                st[lo] = T_T1TINT  # a and b stay: the inner tuple's dims
            elif all_str:
                sc[lo] = (k << 32) | total
                st[lo] = T_TSTR  # a and b: the first string's
            elif k == 5 and st[lo] == T_GLOBAL and sa[lo] >= G_DTYPE \
                    and st[lo + 1] == T_LAYOUT and st[lo + 2] == T_BOOL and st[lo + 3] == T_MEMFMT \
                    and st[lo + 4] == T_BOOL:
                st[lo] = T_PROPSTATE
                sa[lo] = sa[lo] - G_DTYPE
            elif all_atom:
                st[lo] = T_TATOM
            else:
                status = at + 1
                break
            sp = lo + 1
        elif op == 0x93:  # STACK_GLOBAL
            count += 1
            if sp < 2 or st[sp - 1] != T_STR or st[sp - 2] != T_STR:
                status = at + 1
                break
            mpos, mlen, npos, nlen = sa[sp - 2], sb[sp - 2], sa[sp - 1], sb[sp - 1]
            code = -1
            for g in range(gcode.size):
                lo = goff[g]
                hi = goff[g + 1]
                if hi - lo != mlen + 1 + nlen or gtab[lo + mlen] != 0:
                    continue
                same = True
                for k in range(mlen):
                    if data[mpos + k] != gtab[lo + k]:
                        same = False
                        break
                if same:
                    for k in range(nlen):
                        if data[npos + k] != gtab[lo + mlen + 1 + k]:
                            same = False
                            break
                if same:
                    code = gcode[g]
                    break
            if code < 0:
                status = at + 1  # not a global this scan knows (the old way names it, or allows it)
                break
            sp -= 2
            st[sp] = T_GLOBAL
            sa[sp] = code
            sb[sp] = 0
            sp += 1
        elif op == 0x81:  # NEWOBJ: a record, no arguments
            count += 1
            if sp < 2 or st[sp - 2] != T_GLOBAL or st[sp - 1] != T_TINT or sb[sp - 1] != 0:
                status = at + 1
                break
            code = sa[sp - 2]
            if code < C_METADATA or code > C_PLAN:
                status = at + 1
                break
            row = rows[code]
            if row >= obj_cap:
                status = at + 1
                break
            rows[code] += 1
            if code == C_CHUNK:
                chunk[row, 4] = 0
                chunk[row, 5] = -1
                cbuilt[row] = 0
            elif code == C_MDINDEX:
                mdx[row, 2] = -1  # an absent offset is None (a byte object's index has none)
                mdx[row, 3] = 0
                mdx[row, 4] = 0
                mbuilt[row] = 0
            elif code == C_SINFO:
                sinfo[row, 4] = 0
                sbuilt[row] = 0
            elif code == C_TSM:
                tsm[row, 4] = 0
                tsm[row, 3] = -1
                tbuilt[row] = 0
            elif code == C_PROPS:
                props[row] = -1
            elif code == C_PLAN:
                pbuilt[row] = 0
            elif code == C_METADATA:
                md_made += 1
                if md_made > 1:
                    status = at + 1
                    break
            sp -= 2
            st[sp] = T_OBJ
            sa[sp] = code
            sb[sp] = row
            sp += 1
        elif op == 0x52:  # REDUCE
            count += 1
            if sp < 2 or st[sp - 2] != T_GLOBAL:
                status = at + 1
                break
            code = sa[sp - 2]
            t = st[sp - 1]
            if code == G_SIZE and t == T_T1TINT:
                a, b = sa[sp - 1], sb[sp - 1]
                for j in range(a, a + b):
                    if dims[j] < 0:
                        status = at + 1
                if status != 0:
                    break
                sp -= 2
                st[sp] = T_SIZE
                sa[sp] = a
                sb[sp] = b
            elif code == G_LAYOUT and t == T_TSTR and (sc[sp - 1] >> 32) == 1 and sb[sp - 1] == strided.size:
                for k in range(strided.size):
                    if data[sa[sp - 1] + k] != strided[k]:
                        status = at + 1
                if status != 0:
                    break
                sp -= 2
                st[sp] = T_LAYOUT
            elif code == G_MEMFMT and t == T_TINT:
                sp -= 2
                st[sp] = T_MEMFMT
            elif code == G_POSIX and t == T_TSTR and (sc[sp - 1] >> 32) <= MAX_PATH \
                    and (sc[sp - 1] & 0xFFFFFFFF) <= MAX_PATH:
                sp -= 2
                st[sp] = T_PATH
            else:
                status = at + 1
                break
            sp += 1
        elif op == 0x62:  # BUILD: a record takes its state
            if sp < 2 or st[sp - 2] != T_OBJ:
                status = at + 1
                break
            code, row = sa[sp - 2], sb[sp - 2]
            t = st[sp - 1]
            if code == C_PROPS:
                if t != T_PROPSTATE or props[row] >= 0:
                    status = at + 1
                    break
                props[row] = sa[sp - 1]
            else:
                if t != T_DICT:
                    status = at + 1
                    break
                d = sa[sp - 1]
                if not (dicts[d, 0] == D_EMPTY or (dicts[d, 0] == D_STATE and dicts[d, 1] == code
                                                   and dicts[d, 2] == row)):
                    status = at + 1
                    break
                if code == C_CHUNK:
                    done = cbuilt[row]
                    cbuilt[row] = 1
                elif code == C_MDINDEX:
                    done = mbuilt[row]
                    mbuilt[row] = 1
                elif code == C_SINFO:
                    done = sbuilt[row]
                    sbuilt[row] = 1
                elif code == C_TSM:
                    done = tbuilt[row]
                    tbuilt[row] = 1
                elif code == C_METADATA:
                    done = md_built
                    md_built = 1
                elif code == C_SMETA:
                    done = smeta_built
                    smeta_built = 1
                elif code == C_PLAN:
                    done = pbuilt[row]
                    pbuilt[row] = 1
                else:
                    done = 1  # BytesStorageMetadata has no fields: pickle never BUILDs it
                if done:
                    status = at + 1
                    break
            sp -= 1
        elif op == 0x73 or op == 0x75 or op == 0x61 or op == 0x65:  # SETITEM, SETITEMS, APPEND, APPENDS
            if op != 0x61:
                count += 1
            if op == 0x73:
                lo = sp - 2
            elif op == 0x61:
                lo = sp - 1
            else:
                if mp == 0:
                    status = at + 1
                    break
                mp -= 1
                lo = marks[mp]
            if lo < 1:
                status = at + 1
                break
            target = lo - 1
            step = 2 if op == 0x73 or op == 0x75 else 1
            if (sp - lo) % step != 0:
                status = at + 1
                break
            if step == 1:
                if st[target] != T_LIST:
                    status = at + 1
                    break
                li = sa[target]
                for j in range(lo, sp):
                    t = st[j]
                    if t == T_OBJ and sa[j] == C_CHUNK and cbuilt[sb[j]] == 1 and lists[li, 0] != L_OPAQUE:
                        row = sb[j]
                        if lists[li, 0] == L_EMPTY:
                            lists[li, 0] = L_CHUNKS
                            lists[li, 1] = row
                        elif lists[li, 1] + lists[li, 2] != row:
                            status = at + 1  # chunks of one list are rows in a row
                            break
                        lists[li, 2] += 1
                        chunk[row, 5] = li
                    elif lists[li, 0] != L_CHUNKS and (t == T_STR or t == T_INT or t == T_NONE or (
                            t == T_OBJ and sa[j] == C_PLAN and pbuilt[sb[j]] == 1)):
                        lists[li, 0] = L_OPAQUE
                        lists[li, 2] += 1
                    else:
                        status = at + 1
                        break
                if status != 0:
                    break
                sp = lo
                continue
            if st[target] != T_DICT:
                status = at + 1
                break
            d = sa[target]
            if dicts[d, 0] == D_EMPTY and sp > lo:  # its role, from where it is and its first pair
                if target >= 1 and st[target - 1] == T_OBJ and st[lo] == T_STR and dicts[d, 2] < 0:
                    code, row = sa[target - 1], sb[target - 1]
                    unbuilt = (code == C_CHUNK and cbuilt[row] == 0) or (code == C_MDINDEX and mbuilt[row] == 0) \
                        or (code == C_SINFO and sbuilt[row] == 0) or (code == C_TSM and tbuilt[row] == 0) \
                        or (code == C_METADATA and md_built == 0) or (code == C_SMETA and smeta_built == 0) \
                        or (code == C_PLAN and pbuilt[row] == 0)
                    if unbuilt:
                        dicts[d, 0] = D_STATE
                        dicts[d, 1] = code
                        dicts[d, 2] = row
                if dicts[d, 0] == D_EMPTY:
                    if st[lo] == T_STR and st[lo + 1] == T_OBJ and (sa[lo + 1] == C_TSM or sa[lo + 1] == C_BSM):
                        dicts[d, 0] = D_SDM
                    elif st[lo] == T_OBJ and sa[lo] == C_MDINDEX:
                        dicts[d, 0] = D_SD
                    elif st[lo] == T_STR:
                        dicts[d, 0] = D_OPAQUE
                    else:
                        status = at + 1
                        break
            role = dicts[d, 0]
            for j in range(lo, sp, 2):
                kt, vt = st[j], st[j + 1]
                if role == D_SDM:
                    if kt != T_STR or vt != T_OBJ or not (sa[j + 1] == C_BSM or (sa[j + 1] == C_TSM
                                                                                  and tbuilt[sb[j + 1]] == 1)):
                        status = at + 1
                        break
                    r = rows[14]
                    if r >= obj_cap:
                        status = at + 1
                        break
                    rows[14] += 1
                    sdm[r, 0] = d
                    sdm[r, 1] = sa[j]
                    sdm[r, 2] = sb[j]
                    sdm[r, 3] = sa[j + 1]
                    sdm[r, 4] = sb[j + 1]
                elif role == D_SD:
                    if kt != T_OBJ or sa[j] != C_MDINDEX or mbuilt[sb[j]] != 1 or vt != T_OBJ \
                            or sa[j + 1] != C_SINFO or sbuilt[sb[j + 1]] != 1:
                        status = at + 1
                        break
                    r = rows[15]
                    if r >= obj_cap:
                        status = at + 1
                        break
                    rows[15] += 1
                    sd[r, 0] = d
                    sd[r, 1] = sb[j]
                    sd[r, 2] = sb[j + 1]
                elif role == D_OPAQUE:
                    if kt != T_STR or not (vt == T_STR or vt == T_INT or vt == T_NONE or vt == T_BOOL
                                           or vt == T_TSTR or vt == T_TATOM or vt == T_TINT):
                        status = at + 1
                        break
                else:  # D_STATE: a field of its record
                    code, row = dicts[d, 1], dicts[d, 2]
                    if kt != T_STR:
                        status = at + 1
                        break
                    if code == C_PLAN:  # any field, of a value the scan knows (the model never reads it)
                        a, b = sa[j + 1], sb[j + 1]
                        if vt == T_OBJ:
                            ok = (a == C_CHUNK and cbuilt[b] == 1) or (a == C_MDINDEX and mbuilt[b] == 1) \
                                or (a == C_PROPS and props[b] >= 0) or (a == C_PLAN and pbuilt[b] == 1) or a == C_BSM
                        elif vt == T_DICT:
                            ok = dicts[a, 0] == D_OPAQUE or dicts[a, 0] == D_EMPTY
                        elif vt == T_LIST:
                            ok = lists[a, 0] != L_CHUNKS
                        else:
                            ok = vt != T_PROPSTATE and vt != T_GLOBAL and vt != T_T1TINT
                        if not ok:
                            status = at + 1
                            break
                        continue
                    f = 0
                    for g in range(fcode.size):
                        if fclass[g] != code or foff[g + 1] - foff[g] != sb[j]:
                            continue
                        same = True
                        for k in range(sb[j]):
                            if data[sa[j] + k] != ftab[foff[g] + k]:
                                same = False
                                break
                        if same:
                            f = fcode[g]
                            break
                    a, b = sa[j + 1], sb[j + 1]
                    ok = True
                    if f == F_OFFSETS or f == F_SIZES:
                        bit = 1 if f == F_OFFSETS else 2
                        if vt != T_SIZE or chunk[row, 4] & bit:
                            ok = False
                        else:
                            chunk[row, 0 if f == F_OFFSETS else 2] = a
                            chunk[row, 1 if f == F_OFFSETS else 3] = b
                            chunk[row, 4] |= bit
                    elif f == F_FQN or f == F_MOFFSET or f == F_INDEX:
                        bit = 1 if f == F_FQN else 2 if f == F_MOFFSET else 4
                        if mdx[row, 4] & bit:
                            ok = False
                        elif f == F_FQN and vt == T_STR:
                            mdx[row, 0] = a
                            mdx[row, 1] = b
                        elif f == F_MOFFSET and (vt == T_SIZE or vt == T_NONE):
                            mdx[row, 2] = a if vt == T_SIZE else -1
                            mdx[row, 3] = b if vt == T_SIZE else 0
                        elif not (f == F_INDEX and (vt == T_INT or vt == T_NONE)):
                            ok = False
                        mdx[row, 4] |= bit
                    elif f == F_RELPATH or f == F_SOFFSET or f == F_LENGTH or f == F_TRANSFORMS:
                        bit = 1 if f == F_RELPATH else 2 if f == F_SOFFSET else 4 if f == F_LENGTH else 8
                        if sinfo[row, 4] & bit:
                            ok = False
                        elif f == F_RELPATH and vt == T_STR:
                            sinfo[row, 0] = a
                            sinfo[row, 1] = b
                        elif (f == F_SOFFSET or f == F_LENGTH) and vt == T_INT and a >= 0:
                            sinfo[row, 2 if f == F_SOFFSET else 3] = a
                        elif not (f == F_TRANSFORMS and (vt == T_NONE or (vt == T_LIST and lists[a, 2] == 0))):
                            ok = False
                        sinfo[row, 4] |= bit
                    elif f == F_PROPERTIES or f == F_SIZE or f == F_CHUNKS:
                        bit = 1 if f == F_PROPERTIES else 2 if f == F_SIZE else 4
                        if tsm[row, 4] & bit:
                            ok = False
                        elif f == F_PROPERTIES and vt == T_OBJ and a == C_PROPS and props[b] >= 0:
                            tsm[row, 0] = props[b]
                        elif f == F_SIZE and vt == T_SIZE:
                            tsm[row, 1] = a
                            tsm[row, 2] = b
                        elif f == F_CHUNKS and vt == T_LIST and lists[a, 0] != L_OPAQUE:
                            tsm[row, 3] = a
                        else:
                            ok = False
                        tsm[row, 4] |= bit
                    elif f >= F_SDM and f <= F_PLANS:
                        bit = 1 << (f - F_SDM)
                        if meta[0] & bit:
                            ok = False
                        elif f == F_SDM and vt == T_DICT and (dicts[a, 0] == D_SDM or dicts[a, 0] == D_EMPTY):
                            meta[1] = a
                        elif f == F_SD and (vt == T_NONE or (vt == T_DICT and (dicts[a, 0] == D_SD
                                                                                or dicts[a, 0] == D_EMPTY))):
                            meta[2] = a if vt == T_DICT else -1
                        elif f == F_PLANNER and (vt == T_NONE or (vt == T_DICT and (dicts[a, 0] == D_OPAQUE
                                                                                     or dicts[a, 0] == D_EMPTY))):
                            pass
                        elif f == F_SMETA and (vt == T_NONE or (vt == T_OBJ and a == C_SMETA and smeta_built)):
                            pass
                        elif f == F_PLANS and (vt == T_NONE or (vt == T_LIST and lists[a, 0] != L_CHUNKS)):
                            pass
                        elif f == F_VERSION and (vt == T_STR or vt == T_NONE):
                            meta[3] = a if vt == T_STR else -1
                            meta[4] = b if vt == T_STR else 0
                        else:
                            ok = False
                        meta[0] |= bit
                    elif f >= F_CKPTID and f <= F_MODULES:
                        if f == F_CKPTID:
                            ok = vt == T_NONE or vt == T_STR or vt == T_PATH
                        elif f == F_MODULES:
                            ok = vt == T_LIST and lists[a, 0] != L_CHUNKS
                        else:
                            ok = vt == T_STR or vt == T_NONE
                    else:
                        ok = False  # a field this scan does not know
                    if not ok:
                        status = at + 1
                        break
            if status != 0:
                break
            sp = lo
        else:
            status = at + 1  # an opcode DCP's pickles do not use here
            break
        if count > limit:
            status = at + 1
            break
    meta[5] = ndict
    meta[6] = ml
    # views, not copies: the pages past each table's end were never touched, so they cost no memory
    return (status, dims[:nd], chunk[:rows[C_CHUNK]], mdx[:rows[C_MDINDEX]], sinfo[:rows[C_SINFO]],
            tsm[:rows[C_TSM]], props[:rows[C_PROPS]], lists[:nl], sdm[:rows[14]], sd[:rows[15]], meta)


def join(dims: np.ndarray, chunk: np.ndarray, chunk_key: np.ndarray, mdx: np.ndarray, sd_key: np.ndarray,
         sd_rows: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Each storage entry's chunk: ``(status, chunk row per storage entry or -1, numel per chunk)``.

    A chunk is found by its key and its offsets, compared dim by dim (an open-addressing table over
    the chunks, hashed on both). Status 1: two chunks of one key at the same offsets, or two storage
    entries for one chunk (the old way reports those); 2: a chunk's element count past 2**62.
    """
    nc = chunk.shape[0]
    cap = 1
    while cap < 2 * nc + 2:
        cap *= 2
    table = np.full(cap, -1, np.int64)
    numel = np.empty(nc, np.int64)
    for r in range(nc):
        h = np.uint64(chunk_key[r]) * np.uint64(0x9E3779B97F4A7C15)
        a, b = chunk[r, 0], chunk[r, 1]
        for j in range(a, a + b):
            h = (h ^ np.uint64(dims[j])) * np.uint64(0x100000001B3)
        p = np.int64(h & np.uint64(cap - 1))
        while table[p] >= 0:
            q = table[p]
            if chunk_key[q] == chunk_key[r] and chunk[q, 1] == b:
                same = True
                for j in range(b):
                    if dims[chunk[q, 0] + j] != dims[a + j]:
                        same = False
                        break
                if same:
                    return 1, table[:0], numel
            p = (p + 1) & (cap - 1)
        table[p] = r
        m = np.int64(1)
        for j in range(chunk[r, 2], chunk[r, 2] + chunk[r, 3]):
            d = dims[j]
            if d != 0 and m > (np.int64(1) << 62) // d:
                return 2, table[:0], numel
            m *= d
        numel[r] = m
    found = np.full(sd_rows.size, -1, np.int64)
    claimed = np.zeros(nc, np.int8)
    for i in range(sd_rows.size):
        k = sd_key[i]
        row = sd_rows[i]
        a, b = mdx[row, 2], mdx[row, 3]
        if k < 0 or a < 0:
            continue
        h = np.uint64(k) * np.uint64(0x9E3779B97F4A7C15)
        for j in range(a, a + b):
            h = (h ^ np.uint64(dims[j])) * np.uint64(0x100000001B3)
        p = np.int64(h & np.uint64(cap - 1))
        while table[p] >= 0:
            q = table[p]
            if chunk_key[q] == k and chunk[q, 1] == b:
                same = True
                for j in range(b):
                    if dims[chunk[q, 0] + j] != dims[a + j]:
                        same = False
                        break
                if same:
                    if claimed[q]:
                        return 1, found, numel
                    claimed[q] = 1
                    found[i] = q
                    break
            p = (p + 1) & (cap - 1)
    return 0, found, numel


@cache
def compiled_join() -> Any:
    from gtp_format.reader.jit import njit_cached

    return njit_cached(join, nogil=True)


def intern(data: np.ndarray, pos: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Strings by content: ``(id per row, the first row of each id)`` (ids in order of first use).

    Why: DCP writes each storage entry's file name as a string of its own (a million copies of four
    names at 1M chunks); decoding each in Python took longer than the whole scan.
    """
    n = pos.size
    cap = 1
    while cap < 2 * n + 2:
        cap *= 2
    table = np.full(cap, -1, np.int64)  # row of the first string of each slot
    ids = np.empty(n, np.int64)
    firsts = np.empty(n, np.int64)
    nid = 0
    for r in range(n):
        a, b = pos[r], lens[r]
        if r > 0 and a == pos[r - 1] and b == lens[r - 1]:
            ids[r] = ids[r - 1]  # a memo copy of the row before's string (DCP's index names a key per chunk)
            continue
        h = np.uint64(0xCBF29CE484222325) ^ np.uint64(b)
        for k in range(a, a + b):
            h = (h ^ np.uint64(data[k])) * np.uint64(0x100000001B3)
        p = np.int64(h & np.uint64(cap - 1))
        while True:
            q = table[p]
            if q < 0:
                table[p] = r
                ids[r] = nid
                firsts[nid] = r
                nid += 1
                break
            if lens[q] == b:
                same = True
                qa = pos[q]
                for k in range(b):
                    if data[qa + k] != data[a + k]:
                        same = False
                        break
                if same:
                    ids[r] = ids[q]
                    break
            p = (p + 1) & (cap - 1)
    return ids, firsts[:nid]


@cache
def compiled_intern() -> Any:
    from gtp_format.reader.jit import njit_cached

    return njit_cached(intern, nogil=True)
