"""Run many command lines against the hostile corpus, each in a fresh forked child, and measure it.

    python tests/hostile/runner.py ckpt|train JOBS.json RESULTS.json

The parent imports the program once (``ckpt_tool.cli``, or torch and ``gtp_runtime.train``), then
forks one child per job: starting ``python`` and importing torch per input would cost the suite
minutes on two cores. In the child, before the command runs:

* stdout and stderr go to files; the working directory is an empty folder;
* an audit hook records every ``open``, ``os.listdir``/``os.scandir`` and process start. A path
  that resolves (following symlinks, unless opened with ``O_NOFOLLOW``) into the corpus but
  outside the job's checkpoint, or to an absolute location outside the interpreter, the repository
  and the kernel's pseudo files, is a violation; so is any attempt to start a process or run a
  shell;
* ``SIGALRM`` after the job's time limit ends it (its default action needs no Python).

The parent waits with ``os.wait4``: the child's own exit status and peak RSS (``ru_maxrss``), so
memory is measured from the child, not estimated. Results go to RESULTS.json.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[2]
_ALLOWED_ABS = tuple({str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, REPO)}) + (
    "/proc/", "/sys/", "/dev/null", "/dev/urandom", "/dev/shm/", "/usr/", "/lib", "/etc/ld.so", "/etc/localtime")


def _install_audit(corpus: str, allowed: str, log_fd: int) -> None:
    corpus, allowed = os.path.realpath(corpus), os.path.realpath(allowed)
    cwd = os.getcwd()

    def inside(path: str, root: str) -> bool:
        return path == root or path.startswith(root + os.sep)

    def note(what: str) -> None:
        os.write(log_fd, (json.dumps(what) + "\n").encode())

    def check(path: object, flags: int) -> None:
        if isinstance(path, int) or path is None:
            return
        p = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
        if not os.path.isabs(p):  # a name under a confined dir_fd, or under our empty cwd
            if ".." in p.split("/"):
                note(f"relative path with '..': {p!r}")
            return
        nofollow = flags & getattr(os, "O_NOFOLLOW", 0)
        real = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p)) if nofollow \
            else os.path.realpath(p)
        if inside(real, corpus):
            if not inside(real, allowed):
                note(f"opened {p!r} -> {real!r}, outside the checkpoint")
        elif not (real.startswith(_ALLOWED_ABS) or inside(real, cwd) or real.startswith("/tmp/")):
            note(f"opened {p!r} -> {real!r}, outside the checkpoint and the installation")

    def hook(event: str, args: tuple) -> None:
        try:
            if event == "open":
                check(args[0], args[2] if len(args) > 2 and isinstance(args[2], int) else 0)
            elif event in ("os.listdir", "os.scandir"):
                check(args[0], 0)
            elif event in ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.fork"):
                note(f"started a process: {event} {str(args)[:200]}")
        except Exception as e:  # noqa: BLE001 - the hook must never break the program it watches
            note(f"audit hook error {e!r}")

    sys.addaudithook(hook)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(mode: str, job: dict, entry: object) -> int:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(job["cwd"])
    log_fd = os.open(job["audit"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if mode == "train":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(job["port"]))
    _install_audit(job["corpus"], job["allowed"], log_fd)
    signal.alarm(int(job["timeout"]))
    code = entry(job["argv"])  # type: ignore[operator]
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


def main() -> None:
    mode, jobs_path, results_path = sys.argv[1:4]
    if mode == "ckpt":
        from ckpt_tool import cli

        # the copies' and the plan's modules (numpy, the views, the writers), imported once here: a child that
        # imported them itself spent ~1 s of its run on it (test_hostile_options: 77 jobs, 71 s of them)
        from ckpt_tool.export import engine  # noqa: F401
        from ckpt_tool.reshard import megatron_dp  # noqa: F401

        entry = cli.run
    else:
        import torch  # noqa: F401 - imported once, before the forks
        import torch.distributed  # noqa: F401

        from gtp_runtime import train
        from gtp_runtime.checkpoint import io  # noqa: F401
        from gtp_runtime.training import Trainer  # noqa: F401

        entry = train.main
    jobs = json.loads(Path(jobs_path).read_text())
    results = {}
    for job in jobs:
        job["port"] = _free_port()
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 98
            try:
                code = _child(mode, job, entry)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 2
            except BaseException:  # noqa: BLE001 - report, then leave without running the parent's cleanup
                import traceback

                traceback.print_exc()
                code = 99
            finally:
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        results[job["id"]] = {
            "exit": os.waitstatus_to_exitcode(status), "seconds": round(time.monotonic() - t0, 3),
            "maxrss_mb": round(usage.ru_maxrss / 1024, 1),  # KiB on Linux
        }
    Path(results_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
