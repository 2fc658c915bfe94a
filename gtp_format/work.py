"""Hidden work folders: who owns one, whether that owner still lives, and cleaning up after the dead.

Every writer builds its output in a hidden sibling of where it will appear (``.{tag}.{name}.w…``)
and renames it into place. A process killed with SIGKILL cannot remove its work folder: the
fault-injection campaign found 581 MB of them after 46 killed saves, and up to 61 MB beside a CLI
destination. So the owner is written into the work folder's *name*, at the ``mkdir`` that creates it:
``w{host}{boot}-{pid}-{start}-{nonce}`` (a hash of the host name and pid namespace, the kernel's
boot id, the process id and its start time in clock ticks). ``mkdir`` is atomic, so there is no
moment where a folder exists without its owner.

A name proves nothing, though: any folder *named* like a dead writer's work folder was deleted with
its contents. So the writer also proves that it made the folder: at creation it writes a random
token (:data:`TOKEN_FILE`, 32 hex digits) inside, and the name's ``nonce`` is the token's SHA-256
prefix, the writer's record of it (:func:`new_work`). Cleanup removes a folder only when its token
matches its name (:func:`proven`); a folder without one, or whose token does not match, is never
removed, only listed (``ckpt inspect``). The token leaves the folder right after the commit rename
(:func:`drop_token`), so a committed checkpoint keeps exactly the files the format defines. The
proof is against accidents (a user's folder, a copy, a folder of another tool), not against someone
who writes a matching token on purpose: such a folder is theirs to delete anyway. Entries made
without a token (the temporary files of :func:`gtp_format.commit.write_atomic`, the ``old`` copy a
replace moves aside) are never proven: a dead writer's are listed, not removed.

A folder is empty, and has no token in it, at two moments: just after its ``mkdir`` and just before its
``rmdir``. A kill at either left an empty folder named like a work folder that nothing proved ours, for good:
cleanup may not remove it by its name (seen in the upload kill test, seed 6, now and then; an ``rmdir``-if-empty rule
was tried and reverted, since it takes any empty folder so named, one a user or a test made too). So at both
moments the token lies *beside* the folder, in its proof file (the folder's name + :data:`PROOF_SUFFIX`):
:func:`new_work` writes the proof file first, makes the folder, then renames the proof into it as its token;
:func:`remove_owned` empties the folder with the token inside, renames the token out to the proof file, removes
the folder, then the proof file. Every state a kill can leave is proven: the folder with its token, the
(empty) folder with its proof beside it, or the proof file alone (proven by its own content); cleanup removes
each, a proof file only once its folder is gone. ``rename(2)`` is atomic (the proof file and the folder share a
file system), so there is no moment with the folder present and neither token nor proof.

A work folder is *stale* when its owner is on this host and is dead: another boot, no such pid, or
a pid whose start time differs (the pid was reused). A folder of another host (a shared file
system) or without an owner tag (written before owners were recorded) is never touched: nobody can
tell here whether its writer still runs. Stale, proven folders are removed by the next writer into
the same parent (:func:`clean_stale`) and listed by ``ckpt inspect`` (:func:`leftovers`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gtp_format.names import WORK_TOKEN_FILE

WORK_TAGS = ("tmp", "old", "migrate")
TOKEN_FILE = WORK_TOKEN_FILE
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
PROOF_SUFFIX = ".token"  # a work folder's proof file beside it: its token while the folder is made or removed
_WORK_RE = re.compile(r"^\.(?P<tag>[a-z]+)\.(?P<name>.+)\.w(?P<host>[0-9a-f]{8})(?P<boot>[0-9a-f]{8})"
                      r"-(?P<pid>\d{1,10})-(?P<start>\d{1,20})-(?P<nonce>[0-9a-f]{6})(?P<proof>\.token)?$")
_LEGACY_RE = re.compile(r"^\.(?P<tag>tmp|old|migrate)\.(?P<name>.+)\.(?P<nonce>[0-9a-f]{8})$")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _boot_id() -> str:
    raw = _read("/proc/sys/kernel/random/boot_id").strip()
    return hashlib.sha256(raw.encode()).hexdigest()[:8] if raw else "00000000"


def _host_id() -> str:
    """The host name and the pid namespace: containers share the kernel (and its boot id) but not
    their pids, so a pid is only compared with processes of the namespace that recorded it."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (Linux ``/proc/PID/stat`` field 22); None: unknown."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        return None
    try:
        return int(raw.rsplit(")", 1)[1].split()[19])  # the command name may hold spaces and ')'
    except (IndexError, ValueError):
        return None


def _token_nonce(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:6]


def owner_tag(token: str | None = None) -> str:
    """This process as a work-folder owner (computed per call: a forked child is another owner);
    ``token``: the nonce records it (:func:`new_work`), else it is random."""
    pid = os.getpid()
    nonce = _token_nonce(token) if token is not None else uuid.uuid4().hex[:6]
    return f"w{_host_id()}{_boot_id()}-{pid}-{start_ticks(pid) or 0}-{nonce}"


def work_name(target: Path, tag: str, token: str | None = None) -> Path:
    """The hidden sibling of ``target`` this process builds in: no reader takes a dot-name for a checkpoint."""
    return target.with_name(f".{tag}.{target.name}.{owner_tag(token)}")


def _write_token(folder: Path, token: str, name: str = TOKEN_FILE) -> None:
    fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def proof_of(folder: Path) -> Path:
    """The proof file beside the work folder ``folder``: where its token lies while the folder is made or removed
    (see the module docstring)."""
    return folder.with_name(folder.name + PROOF_SUFFIX)


def new_work(target: Path, tag: str, made: WorkFolders | None = None) -> Path:
    """Create this process's work folder for ``target``, with its ownership token inside (see the module
    docstring); returns it. The token is written first, into the proof file beside the folder, and renamed
    into the folder once it exists, so a crash at any point leaves only proven entries (the proof alone, or
    the empty folder with its proof beside it). ``made``: the session's record of what it created."""
    token = uuid.uuid4().hex
    path = work_name(target, tag, token)
    proof = proof_of(path)
    _write_token(proof.parent, token, proof.name)
    try:
        path.mkdir()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(proof)
        raise
    if made is not None:
        made.add(path)  # before the token moves in: a failure then leaves a folder the session knows it made
    os.rename(proof, path / TOKEN_FILE)
    return path


class WorkFolders:
    """The work folders one session (:class:`gtp_format.session.Session`) created (:func:`new_work`), so that it
    knows what it made and, when it ends by a failure, removes what of it is left: each only if it still holds
    the token its name records (:func:`proven`; never by its name), its token last (:func:`remove_owned`). A
    committed folder was renamed away (or, staged for a bucket, removed after its upload), so nothing of it is
    left to remove. Each writer removes its own on a failure too; this is the session's own account."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: list[Path] = []

    def add(self, path: Path) -> None:
        with self._lock:
            self._made.append(path)

    def made(self) -> list[Path]:
        """Every work folder created in the session, in order."""
        with self._lock:
            return list(self._made)

    def remove_left(self) -> list[Path]:
        """Remove the work folders of this session still there and proven its; the ones removed."""
        removed = []
        for path in self.made():
            for w in (parse_work(path), parse_work(proof_of(path))):
                if w is not None and proven(w) and remove_proven(w):
                    removed.append(w.path)
        return removed


def own_before_removal(folder: Path, tag: str, token: str | None = None) -> Path:
    """Put an ownership token into ``folder`` (a folder this writer is about to move aside and remove: the
    iteration an exchange replaces) and return the hidden name that token proves. Without it a writer
    killed between the exchange and the end of the removal left the old copy, or what of it the removal had
    not reached, under a name nothing proved: kept by every later save (found by the async-save fault cases).

    ``token``: the token of the work folder that replaces ``folder`` (:func:`token_of`), so that the old copy
    is proven under the work folder's name too, where the exchange puts it until the rename to the returned
    name: a kill between those two renames left it under the work name with another token (unproven, kept by
    every later save). Default: a fresh one.
    """
    token = token or uuid.uuid4().hex
    try:
        drop_token(folder)  # one a writer killed between its commit and dropping the token left there
        _write_token(folder, token)
    except OSError:  # a folder this process may not write into: moved aside unproven, as before
        return work_name(folder, tag)
    return work_name(folder, tag, token)


def token_of(folder: Path) -> str | None:
    """The ownership token in ``folder`` (a work folder this process made: :func:`new_work`), or None."""
    try:
        fd = os.open(folder / TOKEN_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        text = os.read(fd, 65).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text if _TOKEN_RE.fullmatch(text) else None


def remove_owned(path: Path, tries: int = 1) -> bool:
    """Remove a work folder of this writer's (or a proven dead writer's) so that every state a kill leaves is
    proven (module docstring): its entries with the token still inside, then the token out to the proof file
    beside it, the ``rmdir``, and the proof file last. ``tries``: rounds while other processes may still be
    adding entries (torchrun ranks of this host stopping): an ``rmdir`` refused for an entry that appeared
    starts another round; after the last, the token goes back in and the folder stays, proven (False)."""
    if not path.is_dir() or path.is_symlink():
        remove_entry(path)
        return True
    proof = proof_of(path)
    for round_ in range(tries):
        if round_:
            time.sleep(0.05)
        with contextlib.suppress(OSError), os.scandir(path) as it:
            for entry in it:
                if entry.name != TOKEN_FILE:
                    remove_entry(Path(entry.path))
        with contextlib.suppress(FileNotFoundError):  # absent: already beside it, or a folder that never had one
            os.rename(path / TOKEN_FILE, proof)
        try:
            os.rmdir(path)
        except FileNotFoundError:  # another thread of this writer removed it
            pass
        except OSError:  # an entry appeared meanwhile: another round, the folder proven by its proof
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(proof)
        return True
    try:
        os.rename(proof, path / TOKEN_FILE)
    except FileNotFoundError:  # no proof, or the folder went meanwhile (its proof with it, or left alone)
        if not os.path.lexists(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(proof)
            return True
    except OSError:
        pass
    return False


def remove_proven(w: WorkFolder) -> bool:
    """Remove the leftover ``w`` (its caller found it :func:`proven`): a folder by :func:`remove_owned`, a proof
    file only once its folder is gone (while the folder is there, the proof is its, and goes with it)."""
    if w.proof:
        if os.path.lexists(w.folder):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(w.path)
        return True
    return remove_owned(w.path)


def drop_token(folder: Path) -> None:
    """Remove the ownership token from a folder this writer just committed (it is no checkpoint file)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / TOKEN_FILE)


def proven(w: WorkFolder) -> bool:
    """Whether ``w`` holds the token its name records: a real folder (not a link) with a regular
    :data:`TOKEN_FILE` of 32 hex digits whose hash is the name's nonce, or, while it is made or removed, such a
    proof file beside it (:func:`proof_of`); a proof file by its own content. Read with ``O_NOFOLLOW``, at most
    64 bytes."""
    if not w.nonce:
        return False
    if w.proof:
        return _holds_token(w.path, w.nonce)
    if w.path.is_symlink() or not w.path.is_dir():
        return False
    return _holds_token(w.path / TOKEN_FILE, w.nonce) or _holds_token(proof_of(w.path), w.nonce)


def _holds_token(path: Path, nonce: str) -> bool:
    """Whether ``path`` is a regular file (not a link) holding a token whose hash is ``nonce``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        text = os.read(fd, 65).decode("ascii", errors="replace").strip()
    except OSError:
        return False
    finally:
        os.close(fd)
    return _TOKEN_RE.fullmatch(text) is not None and _token_nonce(text) == nonce


@dataclass(frozen=True)
class WorkFolder:
    """A hidden work entry found in a folder, and what is known of its owner."""

    path: Path
    tag: str
    target: str  # the name it would be committed as
    pid: int | None
    state: str  # "live", "dead" (its owner is gone), "unknown" (other host or no owner recorded)
    nonce: str = ""  # the token's record (see :func:`proven`); "" for names written before owners were
    proof: bool = False  # the proof file beside a work folder (:func:`proof_of`), not the folder

    @property
    def stale(self) -> bool:
        return self.state == "dead"

    @property
    def folder(self) -> Path:
        """The work folder this entry is or stands for (a proof file's, beside it)."""
        return self.path.with_name(self.path.name.removesuffix(PROOF_SUFFIX)) if self.proof else self.path


def _pid_alive(pid: int, start: int) -> bool:
    """Whether the writer ``pid`` (started at ``start`` ticks) still runs. A zombie does not: a writer
    killed with its parent stays one until the reaper gets to it (seconds, in a container whose init
    reaps late), and its work folder was then kept as a live writer's by the next save."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    raw = _read(f"/proc/{pid}/stat")
    if raw and raw.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"]):
        return False
    ticks = start_ticks(pid)
    return ticks is None or start == 0 or ticks == start


def parse_work(path: Path) -> WorkFolder | None:
    """The work entry ``path`` names, or None when its name is not a writer's work name."""
    m = _WORK_RE.match(path.name)
    if m is None:
        legacy = _LEGACY_RE.match(path.name)
        if legacy is None:
            return None
        return WorkFolder(path, legacy["tag"], legacy["name"], None, "unknown")
    pid, start = int(m["pid"]), int(m["start"])
    if m["host"] != _host_id():
        state = "unknown"
    elif m["boot"] != _boot_id():
        state = "dead"
    else:
        state = "live" if _pid_alive(pid, start) else "dead"
    return WorkFolder(path, m["tag"], m["name"], pid, state, m["nonce"], bool(m["proof"]))


def leftovers(parent: Path, limit: int = 10_000) -> list[WorkFolder]:
    """Hidden work entries in ``parent`` (at most ``limit`` are looked at: a folder is untrusted input)."""
    found: list[WorkFolder] = []
    try:
        with os.scandir(parent) as it:
            for n, entry in enumerate(it):
                if n >= limit:
                    break
                if entry.name.startswith("."):
                    w = parse_work(Path(parent) / entry.name)
                    if w is not None:
                        found.append(w)
    except OSError:
        return []
    return sorted(found, key=lambda w: w.path.name)


def remove_entry(path: Path) -> None:
    """Remove a file or folder tree (never following a symlink out of it)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def clean_stale(parent: Path, keep: Callable[[WorkFolder], bool] | None = None) -> list[Path]:
    """Remove the stale work folders of dead owners in ``parent`` that this tool provably made; return
    what was removed.

    Only folders whose name records an owner of this host that is dead *and* whose token matches
    their name (:func:`proven`) are removed; a live owner's, another host's, one without a recorded
    owner and one without a matching token stay (``ckpt inspect`` lists them). ``keep``: stale copies
    that must stay (the reader may still recover a checkpoint from them, see
    :func:`gtp_format.reader.locate.recover_hidden`).
    """
    removed = []
    for w in leftovers(parent):  # sorted: a folder before its proof file, which goes with it
        if w.stale and proven(w) and not (keep is not None and not w.proof and keep(w)) and remove_proven(w):
            removed.append(w.path)
    return removed


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While inside, SIGTERM and SIGINT are held in the main thread and delivered again on the way out, to
    whatever handler is then in place; elsewhere (another thread, a handler Python did not install) nothing
    changes. For a step whose effect and its record must not be split by a handler that raises: a bucket
    object created and noted as this upload's (a survivor that torchrun's SIGTERM reached between the two
    left an object its clean-up did not know of). Holds for one such step, not for a whole command."""
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in sigs}
    if threading.current_thread() is not threading.main_thread() or any(h is None for h in previous.values()):
        yield
        return
    got: list[int] = []

    def hold(signum: int, frame: object) -> None:
        got.append(signum)

    for s in sigs:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that the writer's clean-up runs as it does on an error."""


@contextlib.contextmanager
def sigterm_raises(replace: bool = False) -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread; elsewhere nothing changes.

    The one SIGTERM context manager, for the writer (its clean-up runs as on an error) and the
    launcher (its ``finally`` stops every rank; :mod:`gtp_runtime.lifeline`). By default only where
    SIGTERM's default action (ending the process at once) is still set, so a handler the program
    installed (or an outer use of this one) stays in charge; ``replace=True`` (the launcher)
    installs it over any handler. The previous handler is restored on the way out.
    """
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or (previous is not signal.SIG_DFL and not replace):
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Terminated("terminated (SIGTERM)")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
