"""A bucket output built by a torchrun job over several nodes: every node stages, checks and uploads its own
files; rank 0 gates the whole output from the nodes' verdicts and commits it through the one writer.

A node's staging folder is local to it (``CKPT_S3_STAGING``), so rank 0 cannot read the files another node
wrote. The sequence, after every rank wrote its files into its node's staging folder (made by the node's
lowest rank with :class:`gtp_format.writer.checkpoint.CheckpointWriter`, adopted by the others) and the
files' entries (size, CRC-32C) were gathered and rank 0 wrote the side files:

1. verdicts (:func:`verdict`): rank 0 broadcasts the entries; each rank lists its node's staged data files,
   takes its share of them by bytes (:func:`gtp_format.ranks.assign` over the node's ranks) and reads each in
   full against its entry (:func:`gtp_format.check.gate.check_written`); its verdict names the node, the
   node's listing, the files it checked and their safetensors headers. A failed check is this rank's one line
   naming the file (every rank's line names this rank);
2. rank 0 checks the verdicts (:func:`check_verdicts`): well formed; every rank's listing is its node's;
   the nodes' listings disjoint and together exactly the planned data files, of their planned sizes; every
   rank checked exactly its share (a verdict for a file that is not the rank's to check is refused, not
   trusted);
3. the gate: rank 0 makes a stand-in for each file of another node (its size, its header from the verdict:
   :func:`gtp_format.check.gate.stand_in`), asks for the ranges the gate decodes beyond that
   (:func:`gtp_format.check.gate.gate_reads`: the bucket-numel vectors), which each owner reads from its
   checked staged file (:func:`answer`, checked by :func:`check_answers`), and runs the writer's gate
   (``check_output``) over the folder;
4. every rank uploads the files it checked (create-only: :meth:`gtp_format.storage.upload.Upload.put_files`);
5. rank 0 commits: the side files, then the commit object (``metadata.json``) last, skipping the uploaded
   names (:attr:`CheckpointWriter.uploaded`).

The entries come from the writers: a checkpoint's data files are hashed as they are written; an
``export --to hf``'s weights files, which no manifest lists, get entries so computed only for this check
(:func:`ckpt_tool.export.engine.export_hf`). A data file that is the commit object (an hf export's one weights
file) is planned on rank 0's node and read by rank 0 itself before the upload.

Nothing is uploaded before every verdict passed and the gate opened the output. After step 4, a failure
before the commit makes every rank delete the objects it created (only those: its own create-only puts that
succeeded), and rank 0's refused commit makes every rank do the same. A rank killed during step 4 cannot
delete the objects it had completed: they stay, without the commit object, so no reader takes the prefix for
a checkpoint (``ckpt verify`` says it is an unfinished upload), and a new run needs a new prefix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gtp_format.check.gate import check_written, gate_reads, stand_in
from gtp_format.errors import FormatError
from gtp_format.manifest import FileEntry
from gtp_format.names import WORK_TOKEN_FILE
from gtp_format.ranks import Group, Peer, RankFailed, assign, fault, faulted
from gtp_format.reader.safetensors_reader import HEADER_LIMIT
from gtp_format.reader.storage import open_regular
from gtp_format.storage.upload import DATA, Upload, new_owner, step_of, sweep
from gtp_format.writer.checkpoint import CheckpointWriter

ANSWER_LIMIT = 64 << 20  # the bytes the gate may ask of other nodes in all (a fixture's: 3,154)
VERDICT_KEYS = frozenset({"node", "listing", "checked", "heads"})

UPLOADING = "while uploading its files"


def leader(peers: list[Peer], rank: int) -> int:
    """The lowest rank on ``rank``'s node: it makes the node's staging folder."""
    return min(p.rank for p in peers if p.node == peers[rank].node)


def node_ranks(peers: list[Peer], node: str) -> list[int]:
    return sorted(p.rank for p in peers if p.node == node)


def data_sizes(entries: Mapping[str, FileEntry], commit: str | None = None) -> dict[str, int]:
    """The data files among an output's entries (the side files and the commit object, ``commit`` or
    ``metadata.json``, are rank 0's), with their sizes."""
    return {n: e.size for n, e in sorted(entries.items()) if step_of(n, commit) == DATA}


def share(listing: Mapping[str, int], ranks: list[int], rank: int) -> list[str]:
    """The files of a node's ``listing`` that ``rank`` (one of the node's ``ranks``) checks and uploads: by
    bytes, as every split here (:func:`gtp_format.ranks.assign`)."""
    names = sorted(listing)
    owners = assign([listing[n] for n in names], len(ranks))
    return [n for n, o in zip(names, owners) if ranks[o] == rank]


def damage(folder: Path, entries: Mapping[str, FileEntry]) -> None:
    """The tests' hook (``CKPT_RANK_FAULT=R:damage``): the disk changed a byte of this rank's first staged file
    after it was written."""
    if not entries or not faulted("damage"):
        return
    first = min(entries)
    with open(folder / first, "r+b") as f:
        f.seek(entries[first].size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def header(folder: Path, rel: str) -> bytes:
    """A staged safetensors file's header as it lies on this node (its 8-byte length and the JSON)."""
    with open_regular(folder, rel) as f:
        raw = f.pread(8, 0)  # type: ignore[attr-defined]
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 0 or n > HEADER_LIMIT:
            raise FormatError(f"{rel}: its safetensors header length {n} is not one this writer wrote")
        return raw + f.pread(n, 8)  # type: ignore[attr-defined]


def verdict(group: Group, writer: CheckpointWriter, entries: Mapping[str, FileEntry]) -> dict[str, Any]:
    """This rank's verdict on its share of its node's staged files (step 1 of the module docstring)."""
    planned = data_sizes(entries, writer.commit_object)
    if not planned and writer.commit_object not in entries:  # the same line on every rank, before any read
        raise FormatError(f"{writer.target}: this output records no entries (size, CRC-32C) of its data files to check "
                          "the staged files against on their nodes; run the job on one node (--nnodes 1), or write "
                          "to a folder every node shares and upload that")
    node = group.peers[group.rank].node
    here = node == group.peers[0].node  # rank 0's folder also holds its side files, which its commit uploads
    with os.scandir(writer.folder) as it:  # another node's: every file it holds (an unplanned one is refused)
        listing = {e.name: e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False)
                   and e.name != WORK_TOKEN_FILE and (e.name in planned or not here)}
    odd = sorted(set(listing) - planned.keys())
    if odd:
        raise FormatError(f"{writer.target}: {odd[0]} lies in {node}'s staging folder but is no data file this output "
                          "recorded; nothing was uploaded or committed")
    mine = share(listing, node_ranks(group.peers, node), group.rank)
    damage(writer.folder, {n: entries[n] for n in mine})
    line = check_written(writer.folder, {n: entries[n] for n in mine})
    if line is not None:
        raise FormatError(f"{writer.target}: staged file {line} (changed on {node}'s disk after it was written); "
                          "nothing was uploaded or committed: run the command again", 1)
    if faulted("claim"):  # the tests' hook: a rank that says it checked a file that is not its own
        mine += [n for n in sorted(listing) if n not in mine][:1]
    heads = {n: header(writer.folder, n) for n in mine if n.endswith(".safetensors")}
    return {"node": node, "listing": listing, "checked": {n: listing[n] for n in mine}, "heads": heads}


def malformed(v: Any) -> str | None:
    """Why ``v`` is no verdict (:func:`verdict`'s shape), or None."""
    if not isinstance(v, dict) or set(v) != VERDICT_KEYS:
        return "not a verdict"
    if not isinstance(v["node"], str):
        return "no node"
    for part in ("listing", "checked"):
        m = v[part]
        if not isinstance(m, dict) or not all(isinstance(k, str) and type(s) is int and s >= 0 for k, s in m.items()):
            return f"its {part} is not a list of files and sizes"
    h = v["heads"]
    if not isinstance(h, dict) or not all(isinstance(k, str) and isinstance(b, bytes) for k, b in h.items()):
        return "its headers are not bytes by file"
    return None


def check_verdicts(peers: list[Peer], entries: Mapping[str, FileEntry], verdicts: list[Any],
                   commit: str | None = None) -> None:
    """Refuse (one line naming the rank, or the file) verdicts that do not cover exactly the planned data files,
    each checked by the rank whose share it is (step 2 of the module docstring). Nothing in a verdict is taken
    on trust before this passed."""
    planned = data_sizes(entries, commit)
    if len(verdicts) != len(peers):
        raise FormatError(f"{len(verdicts)} verdicts for {len(peers)} ranks")
    listings: dict[str, tuple[int, dict[str, int]]] = {}
    for r, v in enumerate(verdicts):
        why = malformed(v)
        if why is not None:
            raise FormatError(f"rank {r}'s verdict on its staged files is malformed ({why}); nothing was uploaded")
        if v["node"] != peers[r].node:
            raise FormatError(f"rank {r}'s verdict names {v['node'][:40]!r}, but rank {r} runs on {peers[r].node}")
        first, listing = listings.setdefault(v["node"], (r, v["listing"]))
        if v["listing"] != listing:
            raise FormatError(f"ranks {first} and {r} list different staged files on {v['node']}; nothing was "
                              "uploaded")
    held: dict[str, str] = {}
    for node, (_, listing) in listings.items():
        for n, size in sorted(listing.items()):
            if n not in planned:
                raise FormatError(f"{node} lists {n[:80]!r} as staged, which is no data file of this output")
            if n in held:
                raise FormatError(f"{n} is staged on both {held[n]} and {node}")
            if size != planned[n]:
                raise FormatError(f"{n} is {size} bytes on {node} but was written as {planned[n]}")
            held[n] = node
    missing = sorted(planned.keys() - held.keys())
    if missing:
        raise FormatError(f"{missing[0]} is staged on no node ({len(missing)} data files are missing)")
    for r, v in enumerate(verdicts):
        node = v["node"]
        due = set(share(listings[node][1], node_ranks(peers, node), r))
        extra, left = sorted(set(v["checked"]) - due), sorted(due - set(v["checked"]))
        if extra:
            raise FormatError(f"rank {r} reported a verdict for {extra[0]}, which is not its to check")
        if left:
            raise FormatError(f"rank {r} did not check {left[0]}, its to check")
        heads = v["heads"]
        want = {n for n in due if n.endswith(".safetensors")}
        if set(heads) != want:
            odd = sorted(set(heads) ^ want)[0]
            raise FormatError(f"rank {r} sent a header for {odd} where none was due (or none where one was)")
        for n, h in heads.items():
            if len(h) < 8 or 8 + int.from_bytes(h[:8], "little") != len(h) or len(h) > planned[n]:
                raise FormatError(f"rank {r} sent a header for {n} that is no safetensors header of its file")


def ask(group: Group, writer: CheckpointWriter, entries: Mapping[str, FileEntry],
        verdicts: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Rank 0: stand-ins for the other nodes' files, and the ranges the gate decodes from them (step 3)."""
    if not writer.gate_pending:
        return {}
    here = group.peers[0].node
    remote = {n: r for r, v in enumerate(verdicts) if v["node"] != here for n in v["checked"]}
    heads = {n: h for v in verdicts for n, h in v["heads"].items()}
    for n in sorted(remote):
        stand_in(writer.folder, n, entries[n].size, {0: heads[n]} if n in heads else {})
    reads = gate_reads(writer.folder, remote, writer.session)
    total = sum(ln for rs in reads.values() for _, ln in rs)
    if total > ANSWER_LIMIT:
        raise FormatError(f"{writer.target}: the gate would decode {total} bytes of other nodes' files (at most "
                          f"{ANSWER_LIMIT}); write to a folder every node shares instead")
    return reads


def answer(writer: CheckpointWriter, mine: Mapping[str, int],
           reads: Mapping[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, bytes]]]:
    """The ranges rank 0's gate asks of the files this rank checked, read from its staged copies."""
    out: dict[str, list[tuple[int, bytes]]] = {}
    for n, ranges in sorted(reads.items()):
        if n not in mine:
            continue
        with open_regular(writer.folder, n) as f:
            out[n] = [(off, bytes(f.pread(ln, off))) for off, ln in ranges]  # type: ignore[attr-defined]
    return out


def check_answers(reads: Mapping[str, list[tuple[int, int]]], owners: Mapping[str, int],
                  answers: list[Any]) -> dict[str, dict[int, bytes]]:
    """Each asked file's ranges from the rank that checked it, exactly the ranges asked (one line naming the
    rank otherwise); an answer of any other rank is refused, not used."""
    out: dict[str, dict[int, bytes]] = {}
    for r, got in enumerate(answers):
        if r == 0 and got is None:
            got = {}
        if not isinstance(got, dict):
            raise FormatError(f"rank {r}'s answer to the gate is malformed")
        for n, ranges in got.items():
            if not isinstance(n, str) or owners.get(n) != r or n not in reads:
                raise FormatError(f"rank {r} answered for {str(n)[:80]!r}, which the gate did not ask of it")
            want = reads[n]
            if (not isinstance(ranges, list) or len(ranges) != len(want) or not all(
                    isinstance(x, tuple) and len(x) == 2 and x[0] == off and isinstance(x[1], bytes)
                    and len(x[1]) == ln for x, (off, ln) in zip(ranges, want))):
                raise FormatError(f"rank {r}'s answer for {n} is not the ranges the gate asked")
            out[n] = dict(ranges)
    left = sorted(reads.keys() - out.keys())
    if left:
        raise FormatError(f"no answer for {left[0]} (asked of rank {owners.get(left[0])})")
    return out


def across_nodes(group: Group, writer: CheckpointWriter, entries: dict[str, FileEntry] | None,
                 failed: BaseException | None) -> Upload:
    """Steps 1-4 of the module docstring on every rank (``entries``: rank 0's broadcast, None where its body
    failed; ``failed``: this rank's own error after the files' gather). Returns this rank's upload (for an
    ``undo`` should the commit be refused)."""

    def mine() -> dict[str, Any]:
        if failed is not None:
            raise failed
        if entries is None:
            return {}  # rank 0 failed: its own line is the exchange's
        return verdict(group, writer, entries)

    verdicts = group.exchange(mine, "while checking its staged files")
    assert entries is not None  # every rank got here: rank 0's body passed
    group.exchange(lambda: check_verdicts(group.peers, entries, verdicts, writer.commit_object) if group.root else None,
                   "while checking the ranks' verdicts")
    reads = group.exchange(lambda: ask(group, writer, entries, verdicts) if group.root else None,
                           "while standing in for the other nodes' files")[0]
    answers = group.exchange(lambda: answer(writer, verdicts[group.rank]["checked"], reads),
                             "while answering the gate")

    def gate() -> None:
        if not group.root:
            return
        commit = writer.commit_object
        if commit is not None and commit in entries:  # a data file that is the commit object (an hf export's one
            # weights file): on rank 0's node (ckpt_tool/export/engine.py), outside the verdicts: rank 0 reads it
            line = check_written(writer.folder, {commit: entries[commit]})
            if line is not None:
                raise FormatError(f"{writer.target}: staged file {line} (changed on {group.peers[0].node}'s disk after "
                                  "it was written); nothing was uploaded or committed: run the command again", 1)
        if not writer.gate_pending:
            return
        owners = {n: r for r, v in enumerate(verdicts) for n in v["checked"]}
        parts = check_answers(reads, owners, answers)
        heads = {n: h for v in verdicts for n, h in v["heads"].items()}
        for n, ranges in parts.items():
            stand_in(writer.folder, n, entries[n].size, {**({0: heads[n]} if n in heads else {}), **ranges})
        writer.check_output()

    group.exchange(gate, "before the commit")
    inner = f"{writer.inner}/" if writer.inner else ""
    rels = [inner + n for n in sorted(verdicts[group.rank]["checked"])]
    # one token for every rank's objects: a survivor can then prove a killed rank's objects the job's (upload.sweep)
    up = Upload(writer.target, commit=writer.commit_object,
                owner=group.broadcast(new_owner() if group.root else None, "while sharing the upload's token"))
    if group.root:
        writer.uploaded = frozenset(inner + n for n in data_sizes(entries, writer.commit_object))

    def put() -> None:
        assert writer.work is not None
        up.put_files(writer.work, rels[:1])
        fault("upload")  # the tests' hook: this rank killed with its first object created
        up.put_files(writer.work, rels[1:])

    try:
        group.exchange(put, UPLOADING)
    except BaseException:
        if UPLOADING not in group.passed:  # passed: every rank's objects are up, and rank 0 may be committing
            up.undo()
            if leader(group.peers, group.rank) == group.rank:  # no rank committed, nor can: a killed rank's too
                sweep(writer.target, up.owner)
        raise
    return up


def refused_commit(group: Group, got: Any, up: Upload) -> None:
    """After the commit's exchange: rank 0's commit refused (``got``: its message and exit code) means no commit
    object, and rank 0 removed what it had uploaded; every rank then removes its own objects and stops."""
    if got is None:
        return
    message, code = got
    up.undo()
    if group.root:
        raise RankFailed(f"rank 0: {message}", code)
    raise RankFailed(f"rank 0 failed while committing: {message}; rank {group.rank} stopped: nothing was "
                     "committed", code)
