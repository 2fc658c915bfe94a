"""A work folder's owner that is a zombie (killed, not yet reaped) is dead: its folder is a dead writer's.

Found by the ``--async-save`` fault cases: ranks killed with their launcher stay zombies until the
container's init reaps them, and the next save kept their work folder as a live writer's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gtp_format.writer import work


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_zombie_owner_is_dead(tmp_path: Path) -> None:
    pid = os.fork()
    if pid == 0:  # the writer: it leaves its work folder and is killed
        work.new_work(tmp_path / "out", "tmp")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (w,) = work.leftovers(tmp_path)
        assert w.pid == pid and w.state == "dead" and work.proven(w)
        assert work.clean_stale(tmp_path) == [w.path] and not w.path.exists()
    finally:
        os.waitpid(pid, 0)
