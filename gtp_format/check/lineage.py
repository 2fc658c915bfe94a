"""The lineage checks of a run folder: ``ckpt log`` prints them, ``--load`` refuses on them.

Every iteration folder is opened through the one reader (:func:`gtp_format.reader.checkpoint.open_checkpoint`:
metadata, manifest, and the chunk records side file; never a data file), its recorded identity taken
from the manifest's ``lineage`` section (:mod:`gtp_format.lineage`), and its content compared with the
iteration before it by the chunk records' hashes, per category (weights, fp32 masters, moments), plus
the recorded step counter and data position. What is found wrong is a problem naming the iteration:

* the recorded iteration or consumed samples disagree with the folder name or go backwards;
* the content (root hash, or weights, masters and moments alike) equals an earlier iteration's
  although steps were taken in between (weights alone unchanged is not stale: a run with ``--lr 0``);
* optimizer state restarted inside one run: the step counter went back, or every moment is zero at a
  step past zero;
* the latest marker names something other than the newest complete iteration;
* another run's iteration mixed in: the run id changes without a recorded load from the run before it;
* the recorded root hash is not what the chunk records hash to, or a parent is not older than its child.

Why in the format package: the runtime (``--load``) and the CLI (``ckpt log``) must apply the same
rules, and the runtime never imports the CLI. Bounds: one manifest and one records file per iteration,
each through the bounded readers; at most :data:`MAX_ITERATIONS` folders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gtp_format.errors import FormatError
from gtp_format.lineage import Lineage, category, digests_of, lineage_of, read_attestation, short, topology_digest
from gtp_format.model import Checkpoint
from gtp_format.names import ITER_DIR_RE, LATEST_FILE, parse_latest
from gtp_format.progress import Progress
from gtp_format.storage.location import ObjectURL

MAX_ITERATIONS = 100_000  # iteration folders one log reads; a run saving every step for 100k steps is far past it
CONTENT = ("weights", "masters", "moments")
WHAT = ("weights", "masters", "moments", "step", "rng", "data")  # the columns of ``changed``


@dataclass
class Entry:
    """One iteration folder as the log sees it."""

    folder: str
    named: int  # the iteration its folder name says
    complete: bool = False
    iteration: int | None = None  # recorded (manifest)
    consumed: int | None = None
    step: int | None = None
    lineage: Lineage | None = None
    root_hash: str | None = None  # computed from the chunk records (or integrity.json for megatron-core)
    digests: dict[str, str] = field(default_factory=dict)
    moments_zero: bool | None = None
    rng: str | None = None  # megatron-core: the digest of its decoded rng_state objects (no chunk records)
    topology: str | None = None
    attestation: dict[str, Any] | None = None
    changed: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def run_id(self) -> str | None:
        return None if self.lineage is None else self.lineage.run_id

    def to_json(self) -> dict[str, Any]:
        p = self.lineage.parent if self.lineage is not None else None
        return {"folder": self.folder, "iteration": self.iteration if self.iteration is not None else self.named,
                "recorded_iteration": self.iteration, "complete": self.complete, "run_id": self.run_id,
                "parent": None if p is None else p.to_json(), "root_hash": self.root_hash,
                "topology": self.topology, "consumed_samples": self.consumed, "step": self.step,
                "changed": dict(self.changed), "attestation": self.attestation,
                "problems": list(self.problems), "notes": list(self.notes)}


@dataclass
class RunLog:
    run: str
    latest: int | None
    entries: list[Entry]
    problems: list[str]  # of the folder itself (the latest marker)
    notes: list[str]

    @property
    def failed(self) -> bool:
        return bool(self.problems) or any(e.problems for e in self.entries)

    def first_problem(self) -> str | None:
        for e in self.entries:
            if e.problems:
                return f"{e.folder}: {e.problems[0]}"
        return self.problems[0] if self.problems else None

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "latest": self.latest, "ok": not self.failed,
                "iterations": [e.to_json() for e in self.entries], "problems": list(self.problems),
                "notes": list(self.notes)}


def iteration_folders(run: Path | ObjectURL) -> list[tuple[int, str]]:
    """The run folder's ``iter_*`` entries by iteration (hidden work folders are not iterations)."""
    from gtp_format.reader.storage import list_dir

    names = [n for n in list_dir(run) if ITER_DIR_RE.match(n)]
    if len(names) > MAX_ITERATIONS:
        raise FormatError(f"{run} holds {len(names)} iter_* folders, more than the {MAX_ITERATIONS} one log reads; "
                          "move old iterations aside or log a copy of the ones you need")
    return sorted((int(n[5:]), n) for n in names)


def _latest(run: Path | ObjectURL, notes: list[str], problems: list[str]) -> int | None:
    from gtp_format.reader.storage import is_regular_inside, read_small_file

    if is_regular_inside(run, LATEST_FILE) is None:
        notes.append(f"no {LATEST_FILE}: nothing is marked latest")
        return None
    text = read_small_file(run / LATEST_FILE, 64, "the latest marker", "").decode("utf-8", "replace").strip()
    n = parse_latest(text)
    if n is None:
        problems.append(f"{LATEST_FILE} holds {ascii(text[:40])}, not an iteration number")
    return n


def read_entry(run: Path | ObjectURL, named: int, folder: str, opened: Checkpoint | None = None,
               session: Any = None) -> Entry:
    """One iteration's identity from its metadata, manifest and chunk records (no data file is read).
    ``opened``: the iteration already opened by the caller (``--load``), not parsed again."""
    from gtp_format.integrity.records import read_records
    from gtp_format.megatron.progress import progress as megatron_progress
    from gtp_format.megatron.topology import is_megatron_core
    from gtp_format.reader.checkpoint import open_checkpoint

    e = Entry(folder=folder, named=named)
    try:
        ckpt = opened if opened is not None else open_checkpoint(run / folder, session=session)
    except FormatError as err:
        e.notes.append(f"not a complete checkpoint, skipped: {err.message}")
        return e
    from gtp_format.names import MEGATRON_METADATA_FILE
    from gtp_format.reader.storage import is_regular_inside

    if is_regular_inside(ckpt.store, MEGATRON_METADATA_FILE) is None:  # every writer's last file
        e.notes.append(f"not a complete checkpoint, skipped: no {MEGATRON_METADATA_FILE}, the file a save writes last")
        return e
    e.complete = True
    m = ckpt.manifest
    if m is not None:
        e.lineage = lineage_of(m.extra, str(ckpt.root))  # a forged section: one line, exit 2 (LineageError)
        e.iteration = m.iteration
        e.step = m.optimizer.step if m.optimizer is not None else None
        e.consumed = e.lineage.consumed_samples if e.lineage is not None else _consumed(m.extra)
        e.topology = topology_digest(m.topology)
        if e.lineage is None:
            e.notes.append("no lineage section (written before lineage): run id and parent unknown")
    elif is_megatron_core(ckpt):  # its progress sits in torch.save blobs: decoded as inert records
        got = megatron_progress(ckpt)
        e.iteration, e.consumed, e.step, e.rng = got.iteration, got.consumed, got.step, got.rng
        e.notes += got.notes
        e.notes.append("megatron-core: no run id or parent recorded; runs told apart by nothing but the checks")
    else:
        e.notes.append("no gtp manifest: iteration, step counter, data position and run id not recorded; "
                       "not checked")
    try:
        att = read_attestation(ckpt.root)
    except FormatError as err:
        e.problems.append(err.message)
        att = None
    e.attestation = None if att is None else att.to_json()
    records = read_records(ckpt)
    if records is not None and records.by_chunk and not records.problems:
        e.root_hash, e.digests = digests_of((k, o, r.digest) for (k, o), r in records.by_chunk.items())
        moments = [r.stats for (k, _), r in records.by_chunk.items() if category(k) == "moments"]
        if moments and all(s is not None for s in moments):
            e.moments_zero = all(s.zeros == s.numel for s in moments if s is not None)
    elif records is not None and records.problems:
        e.problems.append(f"chunk records unusable: {records.problems[0].message}")
    else:
        _integrity_digest(ckpt, e)
    if e.lineage is not None and e.lineage.root_hash is not None and e.root_hash is not None \
            and e.lineage.root_hash != e.root_hash:
        e.problems.append(f"records root hash {short(e.lineage.root_hash)} but its chunk records hash to "
                          f"{short(e.root_hash)} (records edited or the lineage forged)")
    return e


def _consumed(extra: dict[str, Any]) -> int | None:
    from gtp_format.names import CONSUMED_SAMPLES, DATA_POSITION_KEY

    pos = extra.get(DATA_POSITION_KEY)
    n = pos.get(CONSUMED_SAMPLES) if isinstance(pos, dict) else None
    return n if type(n) is int and n >= 0 else None


def _integrity_digest(ckpt: Any, e: Entry) -> None:
    """No chunk records: megatron-core's ``integrity.json`` digests stand for the whole content (no split by
    category); without it the content is not compared."""
    from gtp_format.check.megatron_integrity import read_integrity

    listing, problems = read_integrity(ckpt)
    if listing and not problems:
        e.root_hash = digests_of((name, (), digest) for name, digest in listing.items())[0]
        e.notes.append("no chunk records: content compared by integrity.json file digests (not by category)")
    else:
        e.notes.append("no chunk records and no integrity.json: content not compared")


def _compare(e: Entry, prev: Entry | None) -> None:
    """``changed``: per column, changed / unchanged / n/a (not recorded on one side)."""
    for what in WHAT:
        if prev is None:
            e.changed[what] = "first"
            continue
        if what in CONTENT:
            a, b = prev.digests.get(what), e.digests.get(what)
            if a is None and b is None and e.root_hash is not None and prev.root_hash is not None and not e.digests:
                a, b = prev.root_hash, e.root_hash  # integrity.json: the whole content, one column
        elif what == "step":
            a, b = prev.step, e.step
        elif what == "data":
            a, b = prev.consumed, e.consumed
        else:
            a, b = prev.digests.get("rng", prev.rng), e.digests.get("rng", e.rng)
        e.changed[what] = "n/a" if a is None or b is None else ("unchanged" if a == b else "changed")


def _same_run(e: Entry, prev: Entry) -> bool:
    """``e`` continues ``prev``'s run: the same run id, or a recorded load from it."""
    if e.run_id is None or prev.run_id is None:
        return False
    if e.run_id == prev.run_id:
        return True
    p = e.lineage.parent if e.lineage is not None else None
    return p is not None and (p.run_id == prev.run_id or (p.root_hash is not None and p.root_hash == prev.root_hash))


def check_entries(entries: list[Entry]) -> None:
    """Fill ``changed`` and the problems that compare an iteration with those before it."""
    done = [e for e in entries if e.complete]
    seen: dict[str, Entry] = {}  # root hash -> the first iteration that had it
    content_seen: dict[tuple[str, ...], Entry] = {}
    prev: Entry | None = None
    for e in done:
        _compare(e, prev)
        rec = e.iteration
        if rec is not None and rec != e.named:
            e.problems.append(f"records iteration {rec} but its folder name says {e.named} (copied or renamed?)")
        if e.lineage is not None and e.lineage.iteration != rec:
            e.problems.append(f"lineage says iteration {e.lineage.iteration}, the manifest {rec}")
        p = e.lineage.parent if e.lineage is not None else None
        if p is not None and p.iteration is not None and rec is not None and p.via == "load" and p.iteration >= rec:
            e.problems.append(f"its parent (iteration {p.iteration}) is not older than itself (a loop or a forged "
                              "parent)")
        if prev is not None:
            _against_previous(e, prev)
        earlier = seen.get(e.root_hash) if e.root_hash is not None else None
        key = tuple(e.digests.get(c, "") for c in CONTENT)
        if earlier is None and all(key):
            earlier = content_seen.get(key)
        if earlier is not None and _steps_between(earlier, e):
            e.problems.append(f"content equals {earlier.folder}'s (same root hash) although "
                              f"{_steps_between(earlier, e)} steps were taken in between: a stale save")
        if e.root_hash is not None:
            seen.setdefault(e.root_hash, e)
        if all(key):
            content_seen.setdefault(key, e)
        if e.moments_zero and (e.step or 0) > 0:
            e.problems.append(f"every optimizer moment is zero at step {e.step}: optimizer state restarted")
        prev = e


def _steps_between(a: Entry, b: Entry) -> int:
    ia = a.iteration if a.iteration is not None else a.named
    ib = b.iteration if b.iteration is not None else b.named
    if ib == ia:
        ib = b.named  # a copy under a later name still claims the earlier iteration
    return max(0, ib - ia)


def _against_previous(e: Entry, prev: Entry) -> None:
    if e.iteration is not None and prev.iteration is not None and e.iteration <= prev.iteration \
            and e.iteration == e.named:
        e.problems.append(f"recorded iteration {e.iteration} does not advance past {prev.folder}'s {prev.iteration}")
    same = _same_run(e, prev)
    if e.run_id is not None and prev.run_id is not None and not same:
        e.problems.append(f"run id {short(e.run_id, 8)} follows {prev.folder}'s run {short(prev.run_id, 8)} without a "
                          "recorded load from it: another run's iteration mixed into this folder")
        return
    if not same and not (e.run_id is None and prev.run_id is None):
        return  # neither records a run id (megatron-core, or saved before lineage): checked as one run
    if e.consumed is not None and prev.consumed is not None and e.consumed < prev.consumed:
        e.problems.append(f"consumed samples went back from {prev.consumed} to {e.consumed}")
    elif e.consumed is not None and e.consumed == prev.consumed and _steps_between(prev, e) > 0 \
            and e.iteration == e.named:
        e.problems.append(f"consumed samples stayed at {e.consumed} over {_steps_between(prev, e)} steps: the data "
                          "position did not advance")
    if e.step is not None and prev.step is not None and e.step < prev.step:
        run = f"inside run {short(e.run_id, 8)}" if e.run_id is not None else "(no run id recorded)"
        e.problems.append(f"optimizer step counter went back from {prev.step} to {e.step} {run}: optimizer state "
                          "restarted (dropped on resume?)")


def check_latest(log: RunLog) -> None:
    done = [e for e in log.entries if e.complete]
    if log.latest is None or not done:
        return
    newest = max(done, key=lambda e: e.named)
    if log.latest != newest.named:
        where = next((e for e in log.entries if e.named == log.latest), None)
        what = "which is missing" if where is None else ("which is incomplete" if not where.complete else "")
        log.problems.append(f"{LATEST_FILE} names iteration {log.latest}{', ' + what if what else ''} but the newest "
                            f"complete iteration is {newest.named}")


def read_run(run: Path | ObjectURL, progress: Progress | None = None, total: Any = None,
             opened: Checkpoint | None = None, session: Any = None) -> RunLog:
    """The log of the run folder ``run`` (local or ``s3://``): every iteration, checked. ``total(n)`` is
    told the number of iterations before ``progress(1)`` is called once per iteration read. ``opened``:
    one of its iterations the caller has open already (read from it, not parsed again)."""
    notes: list[str] = []
    problems: list[str] = []
    folders = iteration_folders(run)
    if not folders:
        hint = f"; pass its parent, {run.parent}" if ITER_DIR_RE.match(run.name) else ""
        raise FormatError(f"{run} holds no iter_* folders: not a run folder; pass the folder that holds the "
                          f"iter_XXXXXXX folders and {LATEST_FILE}{hint}")
    latest = _latest(run, notes, problems)
    if total is not None:
        progress = total(len(folders))
    entries = []
    for named, folder in folders:
        mine = opened if opened is not None and opened.root.name == folder else None
        entries.append(read_entry(run, named, folder, mine, session))
        if progress is not None:
            progress(1)
    log = RunLog(run=str(run), latest=latest, entries=entries, problems=problems, notes=notes)
    check_entries(entries)
    check_latest(log)
    return log


def resume_check(run: Path | ObjectURL, folder_name: str, run_text: str,
                 opened: Checkpoint | None = None) -> tuple[str | None, str | None]:
    """Whether ``--load`` may resume from ``run/folder_name``: ``(refusal, note)``.

    Refused: the iteration's own problems (stale, another run's, renamed, optimizer restarted), and a latest
    marker that chose it while a newer complete iteration of *another* run (or one with problems) exists.
    A newer complete iteration of the same run, clean, is what a save that stopped between its commit and
    the marker leaves (the writer's documented recovery resumes from the marker): a note, not a refusal.
    ``run_text``: the run folder as the user can pass it to ``ckpt log``."""
    log = read_run(run, opened=opened)
    target = next((e for e in log.entries if e.folder == folder_name), None)
    hint = f"run `ckpt log {run_text}` to see the run's history"
    if target is not None and target.problems:
        reason = f"{target.folder}: {target.problems[0]}"
    elif log.problems and (target is None or log.latest is None or target.named == log.latest):
        done = [e for e in log.entries if e.complete]
        newest = max(done, key=lambda e: e.named) if done else None
        if target is not None and newest is not None and newest.named > target.named and not newest.problems \
                and newest.run_id is not None and newest.run_id == target.run_id:
            return None, (f"{log.problems[0]} of the same run (a save that stopped before moving the marker?); "
                          f"resuming from iteration {target.named} as the marker says; {hint}")
        reason = log.problems[0]
    else:
        return None, None
    return f"{run}: refusing to resume: {reason}; {hint}, or pass --no-check-lineage to load it anyway", None
