"""The rules a recorded storage path obeys, and the one wording of a read past a file's end.

Shared by the local folder reader (:mod:`gtp_format.reader.storage`) and the bucket reader
(:mod:`gtp_format.storage.objects`): both refuse the same paths with the same words, and neither
may import the other (the import-graph test).
"""

from __future__ import annotations

from pathlib import PurePosixPath


def unsafe_reason(rel: object) -> str | None:
    """Why a recorded storage path is not a plain relative path, or ``None`` if it is one."""
    if not isinstance(rel, str) or not rel:
        return f"storage path {rel!r} is not a non-empty string"
    if "\x00" in rel or "\\" in rel:
        return f"storage path {rel!r} contains a NUL or backslash"
    p = PurePosixPath(rel)
    if p.is_absolute() or (len(rel) > 1 and rel[1] == ":"):
        return f"storage path {rel!r} is absolute"
    if ".." in p.parts:
        return f"storage path {rel!r} contains '..'"
    return None


def past_end_message(rel: str, offset: int, length: int, size: int) -> str:
    return (f"byte range [{offset}, {offset + length}) of {rel} runs past its end ({size} bytes): "
            "the file is truncated or the metadata is wrong")


def addressable(key: str) -> bool:
    """Whether the S3 client can ask for ``key`` at all: obstore refuses a key with an ASCII control character
    (``\\x00``-``\\x1f``, ``\\x7f``) or one that is not UTF-8 (a lone surrogate) before any request.

    A recorded path is untrusted text: such a name is reported as a missing object (no object the client
    can read has it), as the same name is a missing file in a folder, never as a failure of the store.
    """
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key)
