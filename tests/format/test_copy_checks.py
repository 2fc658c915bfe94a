"""The checks the copies go through (issue 22 class 6), each against a brute-force reference.

* :class:`gtp_format.check.integrity.ReadLedger`: pieces read in any order, overlapping or not,
  joined to the whole file's CRC-32C (what ``zlib``/``google_crc32c`` give over the file read
  once), and one flipped bit anywhere (read by the copy or not) refused;
* :func:`gtp_format.check.canonical.overlapping_slices` against a pairwise test of every slice,
  and the canonical-layout check on edited manifests;
* :mod:`gtp_format.check.st_names`: the names and dtypes safetensors cannot store;
* the latest marker: whatever iteration a writer may write, the reader resolves to its folder;
* :func:`gtp_format.layout.params.param_count` equal to the sum over the declared parameters.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import google_crc32c
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gtp_format.check.canonical import check_canonical_layout, check_key_dtypes, overlapping_slices
from gtp_format.check.integrity import DamagedSource, ReadLedger
from gtp_format.check.st_names import name_problem, refuse_unstorable
from gtp_format.dtypes import by_name
from gtp_format.errors import FormatError
from gtp_format.layout.config import ModelConfig
from gtp_format.layout.params import model_params, param_count
from gtp_format.layout.schema import BucketLayout, BufferLayout, ParamLayout
from gtp_format.names import MAX_ITERATION, iter_dir_name, parse_latest
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.locate import locate

REPO = Path(__file__).resolve().parents[2]
FOLD = REPO / "fixtures/gtp/fold_cp2_g2_dp2/iter_0000002"
MEGATRON = REPO / "fixtures/megatron/tp2_dp2_dp_reshardable/iter_0000002"
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("ledger") / "it"
    shutil.copytree(FOLD, dst)
    return dst


def _pieces(draw: st.DrawFn, size: int) -> list[tuple[int, int]]:
    n = draw(st.integers(0, 12))
    out = []
    for _ in range(n):
        a = draw(st.integers(0, size - 1))
        out.append((a, draw(st.integers(1, min(size - a, 50_000)))))
    return out


@st.composite
def reads(draw: st.DrawFn) -> tuple[str, list[tuple[int, int]], int | None, int | None]:
    names = sorted(p.name for p in FOLD.glob("*.distcp"))
    name = draw(st.sampled_from(names))
    size = (FOLD / name).stat().st_size
    flip = draw(st.one_of(st.none(), st.integers(0, size - 1)))
    fill = draw(st.one_of(st.none(), st.integers(0, 2**16)))  # the seed of the keys a background fill skips
    return name, _pieces(draw, size), flip, fill


@SLOW
@given(case=reads())
def test_ledger_joins_any_pieces_to_the_file_crc(fold: Path, case: tuple[str, list[tuple[int, int]], int | None,
                                                                          int | None]) -> None:
    """Brute force: the file's CRC-32C over its bytes; the ledger must agree from any set of pieces, with
    or without a background fill around any set of keys (whose ranges the pieces may overlap)."""
    import random

    name, pieces, flip, fill = case
    path = fold / name
    raw = bytearray((FOLD / name).read_bytes())
    if flip is not None:
        raw[flip] ^= 0x01
    path.write_bytes(bytes(raw))
    try:
        ckpt = open_checkpoint(fold)
        ledger = ReadLedger(ckpt)
        assert ledger.modes[name].want == f"{google_crc32c.value(bytes((FOLD / name).read_bytes())):08x}"
        if fill is not None:
            keys = sorted(ckpt.entries)
            ledger.fill_except(random.Random(fill).sample(keys, random.Random(fill).randint(0, len(keys))))
        for a, n in pieces:
            ledger.record(name, a, memoryview(raw)[a:a + n])
        if flip is None:
            ledger.finish()
            covered = set().union(*(range(a, a + n) for a, n in pieces)) if pieces else set()
            others = sum(p.stat().st_size for p in FOLD.glob("*.distcp") if p.name != name)  # read whole: no piece
            most = len(raw) + others if fill is None else 2 * (len(raw) + others)  # a fill piece may be re-read
            assert len(raw) - len(covered) + others <= ledger.bytes_filled <= most
            assert ledger.bytes_checked == sum(n for _, n in pieces)
        else:
            with pytest.raises(DamagedSource, match=name):
                ledger.finish()
    finally:
        path.write_bytes((FOLD / name).read_bytes())


def test_ledger_checks_zip_crcs_without_a_manifest(tmp_path: Path) -> None:
    """A genuine Megatron checkpoint: each storage record's CRC-32, also for records nobody read."""
    it = tmp_path / "it"
    shutil.copytree(MEGATRON, it)
    ReadLedger(open_checkpoint(it)).finish()  # intact: passes, having read every payload itself
    from gtp_format.model import TENSOR
    from gtp_format.reader.blob import parse_blob
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    ckpt = open_checkpoint(it)
    entry, chunk = next((e, c) for e in ckpt.entries.values() if e.kind == TENSOR for c in e.chunks)
    layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, entry, chunk)))))
    path = it / chunk.storage.file
    raw = bytearray(path.read_bytes())
    raw[chunk.storage.offset + layout.payload_offset] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(DamagedSource, match="CRC-32") as e:
        ReadLedger(open_checkpoint(it)).finish()
    assert entry.key in e.value.message and e.value.exit_code == 1


def _payload(ckpt: object, entry: object, chunk: object) -> tuple[int, int]:
    from gtp_format.reader.blob import parse_blob
    from gtp_format.reader.chunks import chunk_bytes
    from gtp_format.reader.zip_blob import ViewReader

    layout = parse_blob(ViewReader(memoryview(bytes(chunk_bytes(ckpt, entry, chunk)))))
    return chunk.storage.offset + layout.payload_offset, layout.payload_bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ledger_fills_unread_zip_records_beside_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         seed: int) -> None:
    """A genuine Megatron checkpoint: the background fill reads the payload of every record outside the keys
    the copy reads, so the join after the copy reads none of them again (only the wanted keys' payloads, which
    no copy read here), and the check still passes on intact bytes."""
    import random

    import gtp_format.check.integrity as integrity
    from gtp_format.model import TENSOR

    it = tmp_path / "it"
    shutil.copytree(MEGATRON, it)
    ckpt = open_checkpoint(it)
    keys = sorted(k for k, e in ckpt.entries.items() if e.kind == TENSOR)
    wanted = random.Random(seed).sample(keys, random.Random(seed).randint(0, len(keys) // 2))
    payloads = {k: sum(_payload(ckpt, ckpt.entries[k], c)[1] for c in ckpt.entries[k].chunks) for k in keys}
    gap = []
    real = integrity.pread
    monkeypatch.setattr(integrity, "pread", lambda fd, n, pos: gap.append(n) or real(fd, n, pos))
    ledger = ReadLedger(ckpt)
    ledger.fill_except(wanted)
    ledger.finish()
    assert sum(gap) == sum(payloads[k] for k in wanted)  # the rest was read once, by the fill
    assert ledger.bytes_filled == sum(payloads.values())


@pytest.mark.parametrize("damage", ["payload bit", "blob structure"])
def test_ledger_fill_refuses_a_damaged_unread_record(tmp_path: Path, damage: str) -> None:
    """Fault: a record no copy reads, damaged in its payload (the fill's pieces fail its CRC-32) or in its zip
    structure (the fill skips it; the join reads it and says what is wrong): refused, naming the key."""
    from gtp_format.model import TENSOR

    it = tmp_path / "it"
    shutil.copytree(MEGATRON, it)
    ckpt = open_checkpoint(it)
    entry, chunk = next((e, c) for e in ckpt.entries.values() if e.kind == TENSOR for c in e.chunks)
    start, _ = _payload(ckpt, entry, chunk)
    path = it / chunk.storage.file
    raw = bytearray(path.read_bytes())
    if damage == "payload bit":
        raw[start] ^= 0x80
    else:
        raw[chunk.storage.offset:chunk.storage.offset + 4] = b"XXXX"  # no zip local header
    path.write_bytes(bytes(raw))
    ledger = ReadLedger(open_checkpoint(it))
    ledger.fill_except([])
    with pytest.raises(DamagedSource, match="CRC-32" if damage == "payload bit" else "not an intact") as e:
        ledger.finish()
    assert entry.key in e.value.message and e.value.exit_code == 1


# -- the bucket layout ------------------------------------------------------------------------------

def _param(name: str, start: int, end: int) -> ParamLayout:
    return ParamLayout(name, start, end, end - start, (end - start,), (end - start,), (end - start,), None, None, 1, 1)


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), min_size=1, max_size=8), st.integers(1, 90))
@example(slices=[(0, 2), (1, 0)], numel=2)  # an empty slice inside another overlaps nothing (found by this test)
def test_overlap_sweep_equals_pairwise_test(slices: list[tuple[int, int]], numel: int) -> None:
    params = tuple(_param(f"p{i}", a, a + n) for i, (a, n) in enumerate(slices))
    buf = BufferLayout(0, "t", "torch.float32", "torch.float32", False, False, "dp", 1, 1, 0,
                       (BucketLayout(0, numel, numel, params),))
    found = overlapping_slices((buf,))
    outside = any(p.end > numel for p in params)
    overlap = any(max(p.start, q.start) < min(p.end, q.end) for i, p in enumerate(params) for q in params[i + 1:])
    assert bool(found) == (outside or overlap)
    assert all(p.check == "bucket_layout" and p.severity == "error" for p in found)


def _edited(tmp_path: Path, edit: object) -> list:
    it = tmp_path / "it"
    shutil.copytree(FOLD, it)
    doc = json.loads((it / "gtp_manifest.json").read_text())
    edit(doc)  # type: ignore[operator]
    (it / "gtp_manifest.json").write_text(json.dumps(doc))
    ckpt = open_checkpoint(it)
    return check_canonical_layout(ckpt) + check_key_dtypes(ckpt)


def test_canonical_layout_accepts_what_the_runtime_writes(tmp_path: Path) -> None:
    assert _edited(tmp_path, lambda d: None) == []


@pytest.mark.parametrize("edit", [
    lambda d: d["buffers"][0]["buckets"][0]["params"].reverse(),  # reordered: same slices, other names
    lambda d: d["buffers"][0]["buckets"][0].update(numel=d["buffers"][0]["buckets"][0]["numel"] + 64),
    lambda d: d.update(bucket_size=d["bucket_size"] * 2),
    lambda d: d["buffers"][1].update(dp_size=1),
    lambda d: d["buffers"][0]["buckets"][0]["params"][0].update(start=64, end=1088),
])
def test_canonical_layout_refuses_any_other(tmp_path: Path, edit: object) -> None:
    found = _edited(tmp_path, edit)
    assert found and {p.check for p in found} <= {"bucket_layout"}


def test_key_dtype_relabelled(tmp_path: Path) -> None:
    found = _edited(tmp_path, lambda d: d.update(param_dtype="torch.bfloat16"))
    assert {p.check for p in found} == {"bucket_layout", "key_dtype"}


# -- safetensors names ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["__metadata__", "", "w\ud800eight"])
def test_names_safetensors_cannot_store(name: str) -> None:
    assert name_problem(name) is not None
    with pytest.raises(FormatError, match="safetensors cannot store"):
        refuse_unstorable("src", [("ok", by_name("float32")), (name, by_name("float32"))])


def test_duplicates_and_dtypes_without_a_code() -> None:
    assert name_problem("decoder.layers.0.mlp.linear_fc1.weight") is None
    with pytest.raises(FormatError, match="appears twice"):
        refuse_unstorable("src", [("a", by_name("float32")), ("a", by_name("float32"))])
    no_code = [d for d in (by_name(n) for n in ("float32", "bfloat16", "float8_e4m3fn", "uint16", "complex64"))
               if not d.safetensors]
    for d in no_code:
        with pytest.raises(FormatError, match="no code"):
            refuse_unstorable("src", [("a", d)])


# -- the latest marker ------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(iteration=st.one_of(st.integers(0, 10**7 + 5), st.integers(0, MAX_ITERATION)),
       name=st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1,
                    max_size=12).filter(lambda s: s not in (".", "..") and not s.startswith(".tmp")))
def test_every_marker_the_writer_writes_is_one_ckpt_reads(tmp_path: Path, iteration: int, name: str) -> None:
    """The one writer (reshard's and export's nested output) and the one reader agree on every iteration."""
    from gtp_format.writer.checkpoint import CheckpointWriter

    run = tmp_path / f"r{iteration}" / name
    run.parent.mkdir()
    with CheckpointWriter(run, inner=iter_dir_name(iteration), latest=str(iteration)) as w:
        shutil.copy(FOLD / ".metadata", w.folder / ".metadata")
        w.finish(None, None)
        w.commit()
    text = (run / "latest_checkpointed_iteration.txt").read_text()
    assert parse_latest(text.strip()) == iteration
    assert locate(run).folder == run / iter_dir_name(iteration)
    shutil.rmtree(run.parent)


@pytest.mark.parametrize("bad", [MAX_ITERATION + 1, 10**20])
def test_iterations_no_marker_can_name_are_refused(tmp_path: Path, bad: int) -> None:
    from gtp_format.writer.checkpoint import CheckpointWriter

    with pytest.raises(FormatError, match="cannot be named"):
        CheckpointWriter(tmp_path / "out", inner=iter_dir_name(bad), latest=str(bad))
    assert list(tmp_path.iterdir()) == []
    assert parse_latest(str(bad)) is None
    assert parse_latest("\u0661\u0662") is None  # Arabic-Indic digits: int() takes them, the marker does not
    doc = json.loads((FOLD / "gtp_manifest.json").read_text())
    from gtp_format.manifest import ManifestError, parse_manifest

    with pytest.raises(ManifestError, match="iteration"):
        parse_manifest({**doc, "iteration": bad}, "m")


# -- the parameter count ----------------------------------------------------------------------------

@given(vocab=st.integers(1, 300), hidden=st.integers(1, 64), layers=st.integers(1, 9), ffn=st.integers(1, 100),
       experts=st.sampled_from([0, 1, 2, 4]), every=st.integers(1, 4))
def test_param_count_is_exact(vocab: int, hidden: int, layers: int, ffn: int, experts: int, every: int) -> None:
    cfg = dataclasses.replace(ModelConfig(), vocab_size=vocab, hidden=hidden, num_layers=layers, ffn_hidden=ffn,
                              num_experts=experts, moe_every=every)
    brute = 0
    for p in model_params(cfg):
        n = 1
        for d in p.full_shape:
            n *= d
        brute += n
    assert param_count(cfg) == brute
