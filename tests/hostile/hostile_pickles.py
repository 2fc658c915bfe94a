"""Crafted ``.metadata`` pickles: nesting, floods, memo bombs, code, BUILD on globals, odd values.

Each builder returns the bytes of a whole ``.metadata``; :mod:`make_corpus` writes them into a copy
of a genuine checkpoint. Raw opcodes are spelled out so that the corpus needs no pickler (and no
torch) to build.
"""

from __future__ import annotations

import struct


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def u(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


P = b"\x80\x04"
DCP = "torch.distributed.checkpoint.metadata"


def build_pickles(canary: str) -> dict[str, tuple[str, bytes]]:
    """Name -> (class, bytes); the code-running ones would create ``canary`` if anything ran them."""
    pickles: dict[str, tuple[str, bytes]] = {}

    def add(name: str, klass: str, data: bytes) -> None:
        pickles[name] = (klass, data)


    add("deep_tuple_key", "crash", P + b"}" + b")" + b"\x85" * 1_000_000 + b"Ns.")
    add("deep_mark_tuples", "crash", P + b"(" * 200_000 + b")" + b"t" * 200_000 + b".")
    add("deep_append_chain", "crash", P + b"]" * 150_000 + b"a" * 149_999 + b".")
    add("deep_dict_values", "crash", P + (b"}" + u("k")) * 60_000 + b"N" + b"s" * 60_000 + b".")
    add("deep_memo_wrap", "crash", P + b")\x94" + b"h\x00\x85q\x00" * 200_000 + b"h\x00.")
    add("memo_bomb_long_binput", "memory", P + b"Nr\xf0\xff\xff\x7f.")
    add("memo_bomb_put_text", "memory", P + b"Np99999999999\n.")
    add("empty_list_flood", "memory", P + b"]" * 1_000_000 + b".")
    add("empty_dict_flood", "memory", P + b"(" + b"}" * 500_000 + b"l.")
    add("set_copy_bomb", "memory", P + b"(" + b"K\x01" * 20_000 + b"l\x94" + b"("
        + (g("builtins", "set") + b"h\x00\x85R0") * 20_000 + b"N.")
    add("string_flood", "memory", P + b"(" + b"\x8c\x02ab" * 200_000 + b"l.")
    add("os_system", "code", P + g("os", "system") + u(f"touch {canary}") + b"\x85R.")
    add("posix_system_stack_global", "code", P + u("posix") + u("system") + b"\x93" + u(f"touch {canary}") + b"\x85R.")
    add("builtins_exec", "code", P + g("builtins", "exec") + u(f"open({canary!r}, 'w').close()") + b"\x85R.")
    add("subprocess_call", "code", P + g("subprocess", "check_call") + u("touch") + u(canary) + b"\x86\x85R.")
    add("persistent_id", "code", P + u("x") + b"Q.")
    add("ext_registry", "code", P + b"\x82\x01.")
    add("build_on_dtype", "mutation", P + g("torch", "float32") + b"}" + u("itemsize") + b"K\x07sb.")
    add("build_on_layout", "mutation", P + g("torch", "strided") + b"N}" + u("name") + u("evil") + b"s\x86b.")
    add("build_on_record_class", "mutation", P + g(DCP, "Metadata") + b"}" + u("kind") + u("evil") + b"sb.")
    add("build_on_helper_function", "mutation", P + g("torch", "Size") + b"}" + u("__defaults__") + b"K\x07\x85sb.")
    add("setitem_on_global", "mutation", P + g("collections", "OrderedDict") + u("k") + b"K\x01s.")
    add("huge_long4_size", "traceback", P + g(DCP, "Metadata") + b")\x81}" + u("state_dict_metadata") + b"}" + u("w")
        + g(DCP, "TensorStorageMetadata") + b")\x81}" + u("size") + b"\x8b" + struct.pack("<i", 3000) + b"\x7f" * 3000
        + b"\x85" + b"sbs" + b"sb.")
    add("inf_float_size", "traceback", P + g(DCP, "Metadata") + b")\x81}" + u("state_dict_metadata") + b"}" + u("w")
        + g(DCP, "TensorStorageMetadata") + b")\x81}" + u("size") + b"G\x7f\xf0" + b"\x00" * 6 + b"\x85"
        + b"sbs" + b"sb.")
    add("truncated_no_stop", "traceback", P + b"(" + b"K\x01" * 100)
    add("not_an_opcode", "traceback", P + b"\xff.")
    add("stack_underflow", "traceback", P + b"a.")
    add("not_metadata_list", "traceback", P + b"]K\x01a.")
    add("lone_surrogate_in_key", "traceback", P + g(DCP, "Metadata") + b")\x81}" + u("state_dict_metadata") + b"}"
        + u("bad\ud800key") + b"Nssb.")
    return pickles
