"""The benchmarks' out-of-process moto server (``s3_server.moto_process``): it answers S3 calls, and no process of
it outlives the block, even when the block raises."""

from __future__ import annotations

import contextlib
import os
import urllib.request

import pytest
import s3_server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


def _server_pids(port: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if b"moto.server" in args and port.encode() in args:
                out.append(int(d))
    return out


@pytest.mark.parametrize("fail", [False, True])
def test_the_server_process_answers_and_is_gone_after(fail):
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="inside") if fail else contextlib.nullcontext():
        with s3_server.moto_process() as endpoint:
            port = endpoint.rsplit(":", 1)[1]
            pids = _server_pids(port)
            assert pids
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=10) as r:
                assert r.status == 200
            if fail:
                raise RuntimeError("inside")
    assert not any(_alive(p) for p in pids)

