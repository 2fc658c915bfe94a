"""The C unpickler every untrusted pickle goes through, after both pre-walks accepted its bytes.

Why a module of its own: the two walks (:mod:`gtp_format.reader.pickle_scan`, memo indices and
opcodes; :mod:`gtp_format.reader.pickle_shape`, nesting depth and container counts) are pure
checks over bytes, and the unpickler is their one caller. When it lived in ``pickle_scan``, that
module imported ``pickle_shape`` (inside the constructor) and ``pickle_shape`` imported
``pickle_scan``: a circle. Now both walks sit below this module and know nothing of it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
from collections.abc import Iterator
from typing import Any

from gtp_format.reader.pickle_scan import check_pickle
from gtp_format.reader.pickle_shape import check_shape
from gtp_format.reader.pickle_walk import passes

FREEZE_AFTER_LOAD = False
"""Set by short-lived command-line processes (``ckpt``); see :func:`gc_paused`."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a large object graph is built.

    Unpickling a DCP ``.metadata`` creates millions of container objects and none of them is
    garbage yet, but every 700 allocations the collector walks the young generation and now and
    then all of them: measured on a 100,000-chunk file, the C unpickle takes 0.4 s with it paused
    and 1.7 s with it running. Re-enabled on exit only if it was enabled on entry.

    Once re-enabled, the collector would still walk every one of those objects a few times as
    they age through its generations: about 5 s at a million chunks. With
    :data:`FREEZE_AFTER_LOAD` set (the ``ckpt`` CLI does; a library caller decides for its own
    process) the objects are moved to the permanent generation (``gc.freeze``) first, so it never
    walks them; they are still freed by reference counting when dropped (the metadata holds no
    reference cycles), only cycles among them would never be collected.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if FREEZE_AFTER_LOAD:
            gc.freeze()
        if was_enabled:
            gc.enable()


class ScannedUnpickler(pickle.Unpickler):
    """The C unpickler over bytes that :func:`check_pickle` and
    :func:`~gtp_format.reader.pickle_shape.check_shape` accepted; subclasses allow-list globals.

    ``find_class`` must be overridden (the default imports anything); persistent ids are refused,
    since DCP metadata never uses them.
    """

    def __init__(self, data: bytes, source: str) -> None:
        if not passes(data):  # a large pickle both walks would accept, found in one compiled pass: see pickle_walk
            check_pickle(data)
            check_shape(data)  # nesting depth and container count: see pickle_shape
        super().__init__(io.BytesIO(data))
        self.source = source

    def load(self) -> Any:
        with gc_paused():
            return super().load()

    def find_class(self, module: str, name: str) -> Any:
        raise NotImplementedError("subclasses allow-list the globals they resolve")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.source} uses pickle persistent ids, which DCP metadata never does")
