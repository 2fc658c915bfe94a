"""The verdicts of a bucket output built on several nodes (``ckpt_tool/copying/nodes.py``) as input to rank 0:
what another rank says it checked is refused, in one line naming the rank or the file, unless the verdicts
cover exactly the planned data files, each checked by the rank whose share it is; the gate's answers likewise.
No process group is needed: rank 0's checks are plain functions of what the ranks sent."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ckpt_tool.copying.nodes import check_answers, check_verdicts, share
from gtp_format.errors import FormatError
from gtp_format.manifest import FileEntry
from gtp_format.ranks import Peer

PEERS = [Peer(r, "h", 100 + r, f"node {r // 2}") for r in range(4)]  # 2 nodes x 2 ranks
HEAD = (14).to_bytes(8, "little") + b'{"__meta": {}}'
SIZES = {"__0_0.safetensors": 4000, "__1_0.safetensors": 3000, "__2_0.safetensors": 2000, "__3_0.safetensors": 1000,
         "__4_0.safetensors": 900, "__5_0.safetensors": 800}
NODE = {"node 0": ["__0_0.safetensors", "__3_0.safetensors", "__4_0.safetensors"],
        "node 1": ["__1_0.safetensors", "__2_0.safetensors", "__5_0.safetensors"]}
ENTRIES = {**{n: FileEntry(s, {"crc32c": "00000000"}) for n, s in SIZES.items()},
           "index.json": FileEntry(10, {}), "gtp_manifest.json": FileEntry(10, {})}  # side files: rank 0's


def verdicts() -> list[dict[str, Any]]:
    out = []
    for p in PEERS:
        listing = {n: SIZES[n] for n in NODE[p.node]}
        mine = share(listing, [q.rank for q in PEERS if q.node == p.node], p.rank)
        out.append({"node": p.node, "listing": listing, "checked": {n: listing[n] for n in mine},
                    "heads": {n: HEAD for n in mine}})
    return out


def refused(vs: list[Any], words: str) -> None:
    with pytest.raises(FormatError) as e:
        check_verdicts(PEERS, ENTRIES, vs)
    assert words in e.value.message and "\n" not in e.value.message, e.value.message


def test_the_honest_verdicts_pass() -> None:
    vs = verdicts()
    check_verdicts(PEERS, ENTRIES, vs)
    assert sorted(n for v in vs for n in v["checked"]) == sorted(SIZES)  # every planned file, once


@pytest.mark.parametrize("bad", [None, [], "ok", {"node": "node 1"}, {**verdicts()[3], "extra": 1}])
def test_a_malformed_verdict_is_refused_naming_its_rank(bad: Any) -> None:
    vs = verdicts()
    vs[3] = bad
    refused(vs, "rank 3's verdict on its staged files is malformed")


@pytest.mark.parametrize(("part", "value"), [
    ("listing", {"__1_0.safetensors": -1}), ("listing", {"__1_0.safetensors": True}), ("listing", [1, 2]),
    ("checked", {"__1_0.safetensors": "3000"}), ("heads", {"__1_0.safetensors": "not bytes"}), ("node", 1),
])
def test_a_verdict_of_the_wrong_types_is_refused(part: str, value: Any) -> None:
    vs = verdicts()
    vs[2][part] = value
    refused(vs, "rank 2's verdict on its staged files is malformed")


def test_a_verdict_for_a_file_it_does_not_own_is_refused() -> None:
    vs = verdicts()
    other = next(iter(vs[3]["checked"]))  # its node peer's file
    vs[2]["checked"][other] = SIZES[other]
    vs[2]["heads"][other] = HEAD
    refused(vs, f"rank 2 reported a verdict for {other}, which is not its to check")
    vs = verdicts()
    far = NODE["node 0"][0]  # another node's file: its listing no longer matches its node's
    vs[2]["checked"][far] = SIZES[far]
    vs[2]["listing"][far] = SIZES[far]
    refused(vs, "ranks 2 and 3 list different staged files on node 1")


def test_a_file_its_share_left_unchecked_is_refused() -> None:
    vs = verdicts()
    gone = sorted(vs[1]["checked"])[0]
    del vs[1]["checked"][gone]
    vs[1]["heads"].pop(gone)
    refused(vs, f"rank 1 did not check {gone}")


def test_a_node_claiming_a_file_no_rank_wrote_is_refused() -> None:
    vs = verdicts()
    for r in (2, 3):
        vs[r]["listing"]["../../outside.safetensors"] = 1
    refused(vs, "node 1 lists '../../outside.safetensors' as staged, which is no data file of this output")


def test_a_file_on_two_nodes_or_on_none_or_of_another_size_is_refused() -> None:
    vs = verdicts()
    twice = NODE["node 0"][0]
    for r in (2, 3):
        vs[r]["listing"][twice] = SIZES[twice]
    refused(vs, f"{twice} is staged on both node 0 and node 1")
    vs = verdicts()
    gone = NODE["node 1"][-1]
    for r in (2, 3):
        vs[r]["listing"].pop(gone)
        vs[r]["checked"].pop(gone, None)
        vs[r]["heads"].pop(gone, None)
    refused(vs, f"{gone} is staged on no node")
    vs = verdicts()
    for r in (2, 3):
        vs[r]["listing"][gone] = 7
    refused(vs, f"{gone} is 7 bytes on node 1 but was written as {SIZES[gone]}")


def test_a_verdict_naming_another_node_is_refused() -> None:
    vs = verdicts()
    vs[1] = copy.deepcopy(vs[2])
    refused(vs, "rank 1's verdict names 'node 1', but rank 1 runs on node 0")


@pytest.mark.parametrize("head", [b"", b"\x00" * 7, (99).to_bytes(8, "little") + b"{}",
                                  (1 << 40).to_bytes(8, "little")])
def test_a_header_that_is_no_header_of_its_file_is_refused(head: bytes) -> None:
    vs = verdicts()
    name = sorted(vs[2]["heads"])[0]
    vs[2]["heads"][name] = head
    refused(vs, f"rank 2 sent a header for {name} that is no safetensors header of its file")


def test_a_header_for_a_file_it_did_not_check_is_refused() -> None:
    vs = verdicts()
    vs[0]["heads"][NODE["node 1"][0]] = HEAD
    refused(vs, "rank 0 sent a header for")


def test_verdicts_of_fewer_ranks_than_the_job_are_refused() -> None:
    refused(verdicts()[:3], "3 verdicts for 4 ranks")


READS = {"__1_0.safetensors": [(100, 4), (200, 2)]}
OWNERS = {"__1_0.safetensors": 2}


def test_the_gate_takes_only_the_ranges_it_asked_of_their_owner() -> None:
    good: list[Any] = [None, {}, {"__1_0.safetensors": [(100, b"abcd"), (200, b"ef")]}, {}]
    assert check_answers(READS, OWNERS, good) == {"__1_0.safetensors": {100: b"abcd", 200: b"ef"}}
    cases: list[tuple[list[Any], str]] = [
        ([None, {}, {}, {"__1_0.safetensors": [(100, b"abcd"), (200, b"ef")]}], "rank 3 answered for"),
        ([None, {}, {"__1_0.safetensors": [(100, b"abc"), (200, b"ef")]}, {}], "rank 2's answer for __1_0"),
        ([None, {}, {"__1_0.safetensors": [(101, b"abcd"), (200, b"ef")]}, {}], "rank 2's answer for __1_0"),
        ([None, {}, {"__1_0.safetensors": [(100, b"abcd")]}, {}], "rank 2's answer for __1_0"),
        ([None, {}, {"__1_0.safetensors": [(100, "abcd"), (200, b"ef")]}, {}], "rank 2's answer for __1_0"),
        ([None, {}, {"__2_0.safetensors": []}, {}], "rank 2 answered for '__2_0.safetensors'"),
        ([None, {}, {}, {}], "no answer for __1_0.safetensors (asked of rank 2)"),
        ([None, {}, "bytes", {}], "rank 2's answer to the gate is malformed"),
    ]
    for answers, words in cases:
        with pytest.raises(FormatError) as e:
            check_answers(READS, OWNERS, answers)
        assert words in e.value.message, (answers, e.value.message)


def test_a_refused_commit_makes_every_rank_remove_its_own_objects() -> None:
    """Rank 0's commit refused (e.g. an object of the prefix appeared meanwhile): it removed what it uploaded, and
    every rank removes the objects its own create-only puts made, then stops with rank 0's line."""
    from ckpt_tool.copying.nodes import refused_commit
    from gtp_format.ranks import Group, RankFailed

    class Up:
        undone = 0

        def undo(self) -> None:
            self.undone += 1

    for rank in (0, 2):
        up = Up()
        refused_commit(Group(rank, 4, PEERS), None, up)  # type: ignore[arg-type]
        assert up.undone == 0  # committed: nothing is removed
        with pytest.raises(RankFailed) as e:
            refused_commit(Group(rank, 4, PEERS), ("s3://b/dst: objects already exist", 2), up)  # type: ignore[arg-type]
        assert up.undone == 1 and "objects already exist" in e.value.message and e.value.exit_code == 2
        assert e.value.message.startswith("rank 0")


def _staged(folder: Any) -> tuple[Any, dict[str, FileEntry]]:
    """A node's staging folder of two safetensors files and their entries, and a writer that adopted it."""
    from gtp_format.writer.checkpoint import CheckpointWriter, file_entry

    folder.mkdir()
    for name, n in (("__1_0.safetensors", 300), ("__2_0.safetensors", 200)):
        (folder / name).write_bytes(HEAD + bytes(range(256)) * (n // 256 + 1))
    entries = {p.name: file_entry(p) for p in sorted(folder.iterdir())}
    writer = CheckpointWriter(folder.parent / "dst")
    writer.adopt(folder)
    return writer, entries


def test_a_rank_checks_its_share_of_its_node_and_sends_their_headers(tmp_path: Any) -> None:
    from ckpt_tool.copying.nodes import verdict
    from gtp_format.ranks import Group

    writer, entries = _staged(tmp_path / "node1")
    got = [verdict(Group(r, 4, PEERS), writer, entries) for r in (2, 3)]
    assert got[0]["listing"] == got[1]["listing"] == {n: e.size for n, e in entries.items()}
    assert sorted([*got[0]["checked"], *got[1]["checked"]]) == sorted(entries)  # each file by one rank
    assert all(h == HEAD for v in got for h in v["heads"].values())


def test_a_rank_refuses_an_unrecorded_staged_file_and_an_output_without_entries(tmp_path: Any) -> None:
    from ckpt_tool.copying.nodes import verdict
    from gtp_format.ranks import Group

    writer, entries = _staged(tmp_path / "node1")
    (tmp_path / "node1" / "__9_0.safetensors").write_bytes(b"x")  # on another node than rank 0's: no stray file
    with pytest.raises(FormatError, match="__9_0.safetensors lies in node 1's staging folder but is no data file"):
        verdict(Group(2, 4, PEERS), writer, entries)
    with pytest.raises(FormatError, match="records no entries"):  # an output with no entries: nothing to check against
        verdict(Group(2, 4, PEERS), writer, {})


def test_a_staged_file_changed_after_its_write_is_its_checkers_one_line(tmp_path: Any) -> None:
    from ckpt_tool.copying.nodes import verdict
    from gtp_format.ranks import Group

    writer, entries = _staged(tmp_path / "node1")
    for name in entries:
        raw = bytearray((tmp_path / "node1" / name).read_bytes())
        raw[-1] ^= 0xFF
        (tmp_path / "node1" / name).write_bytes(bytes(raw))
    for r in (2, 3):
        with pytest.raises(FormatError) as e:
            verdict(Group(r, 4, PEERS), writer, entries)
        assert "staged file __" in e.value.message and "crc32c is" in e.value.message
        assert "changed on node 1's disk" in e.value.message and e.value.exit_code == 1


# export --to hf across nodes: the weights files have entries (size, CRC-32C as written); config.json is the commit
# object and the indexes, config and attestation are rank 0's side files
HF = {"model-00001-of-00003.safetensors": 4000, "model-00002-of-00003.safetensors": 3000,
      "model-00003-of-00003.safetensors": 500, "optimizer-00001-of-00002.safetensors": 2500,
      "optimizer-00002-of-00002.safetensors": 2400}
HF_NODE = {"node 0": ["model-00001-of-00003.safetensors", "optimizer-00002-of-00002.safetensors"],
           "node 1": ["model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                      "optimizer-00001-of-00002.safetensors"]}
HF_ENTRIES = {n: FileEntry(s, {"crc32c": "00000000"}) for n, s in HF.items()}


def hf_verdicts() -> list[dict[str, Any]]:
    out = []
    for p in PEERS:
        listing = {n: HF[n] for n in HF_NODE[p.node]}
        mine = share(listing, [q.rank for q in PEERS if q.node == p.node], p.rank)
        out.append({"node": p.node, "listing": listing, "checked": {n: listing[n] for n in mine},
                    "heads": {n: HEAD for n in mine}})
    return out


def test_hf_weights_files_across_nodes_pass_only_as_planned() -> None:
    """``export --to hf`` to a bucket from 2 nodes: the honest verdicts pass; a side file listed by a node, a
    weights file missing or staged twice, one of another size, a header for the commit object, a file checked by
    the wrong rank: each refused in one line naming the rank or the file."""
    check_verdicts(PEERS, HF_ENTRIES, hf_verdicts(), "config.json")
    cases: list[tuple[Any, str]] = []
    vs = hf_verdicts()
    for r in (2, 3):
        vs[r]["listing"]["model.safetensors.index.json"] = 900  # rank 0's side file, staged on node 1
    cases.append((vs, "node 1 lists 'model.safetensors.index.json' as staged, which is no data file"))
    vs = hf_verdicts()
    for r in (2, 3):
        vs[r]["listing"]["config.json"] = 700  # the commit object is rank 0's to upload last
    cases.append((vs, "node 1 lists 'config.json' as staged, which is no data file"))
    vs = hf_verdicts()
    gone = "model-00003-of-00003.safetensors"
    for r in (2, 3):
        vs[r]["listing"].pop(gone)
        vs[r]["checked"].pop(gone, None)
        vs[r]["heads"].pop(gone, None)
    cases.append((vs, f"{gone} is staged on no node"))
    vs = hf_verdicts()
    twice = "model-00001-of-00003.safetensors"
    for r in (2, 3):
        vs[r]["listing"][twice] = HF[twice]
    cases.append((vs, f"{twice} is staged on both node 0 and node 1"))
    vs = hf_verdicts()
    for r in (2, 3):
        vs[r]["listing"]["model-00002-of-00003.safetensors"] = 2999
    cases.append((vs, "model-00002-of-00003.safetensors is 2999 bytes on node 1 but was written as 3000"))
    vs = hf_verdicts()
    vs[3]["heads"]["config.json"] = HEAD
    cases.append((vs, "rank 3 sent a header for config.json where none was due"))
    vs = hf_verdicts()
    theirs = next(iter(vs[2]["checked"]))
    vs[3]["checked"][theirs] = HF[theirs]
    vs[3]["heads"][theirs] = HEAD
    cases.append((vs, f"rank 3 reported a verdict for {theirs}, which is not its to check"))
    for vs, words in cases:
        with pytest.raises(FormatError) as e:
            check_verdicts(PEERS, HF_ENTRIES, vs, "config.json")
        assert words in e.value.message and "\n" not in e.value.message, (words, e.value.message)


def test_an_hf_export_whose_commit_object_is_a_weights_file_must_write_it_on_rank_0s_node() -> None:
    """``--names megatron`` with one model file: that file is the commit object, which rank 0 uploads last from
    its own staging; where the split by bytes gives it to a rank of another node, every rank refuses before a
    byte is written (one line naming the file, the rank and the fix)."""
    from ckpt_tool.export.engine import commit_on_root_node
    from gtp_format.ranks import Group

    def part(n: int) -> list[Any]:
        return [type("Chunk", (), {"nbytes": n})()]  # what the split reads of a chunk: its bytes

    files = ["model.safetensors", "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"]
    # by bytes, largest first: the optimizer files go to ranks 0 and 1 (node 0), the model file to rank 2 (node 1)
    parts = [part(100), part(300), part(200)]
    with pytest.raises(FormatError) as e:
        commit_on_root_node(Group(2, 4, PEERS), parts, files, "model.safetensors", "s3://b/hf")
    assert "model.safetensors, this export's commit object" in e.value.message and "rank 2 on node 1" in \
        e.value.message and "--max-shard-size" in e.value.message
    commit_on_root_node(Group(2, 4, PEERS), [part(300), part(100), part(200)], files, "model.safetensors",
                        "s3://b/hf")  # on rank 0 itself
    commit_on_root_node(Group(2, 4, PEERS), parts, files, "config.json", "s3://b/hf")  # not a weights file
