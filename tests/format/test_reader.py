"""The checkpoint model built by the readers, from real DCP saves."""

from __future__ import annotations

import pickle
from pathlib import Path

import ckpt_factory as F
import pytest
import torch

from gtp_format.check.analysis import aliasing, classify_all, topology_view
from gtp_format.dtypes import DTYPES
from gtp_format.errors import FormatError
from gtp_format.layout.config import ParallelConfig
from gtp_format.model import BYTES, ENC_RAW, ENC_TORCH_SAVE, TENSOR
from gtp_format.names import writer_rank
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.chunks import load_chunk, load_object, load_plain


def _boxes(entry):
    return sorted((c.offsets, c.sizes) for c in entry.chunks)


def test_torch_dist_model(ckpts: Path):
    ck = open_checkpoint(ckpts / "good")  # the parent: follows latest_checkpointed_iteration.txt
    assert ck.root.name == "iter_0000010" and ck.iteration == F.ITERATION
    assert ck.layout == "torch_dist" and ck.backend == "megatron torch_dist" and ck.encoding == ENC_TORCH_SAVE
    assert ck.manifest is not None and ck.manifest.topology == ParallelConfig(**F.TOPOLOGY)
    qkv = ck.entries[F.QKV]
    assert (qkv.kind, qkv.shape, qkv.dtype.torch) == (TENSOR, F.QKV_SHAPE, torch.float32)
    assert _boxes(qkv) == [((0, 0), (8, 8)), ((8, 0), (8, 8))]
    want = sorted(((s,), (n,)) for spans in F.OPT_CHUNKS.values() for s, n in spans)
    for state in F.STATES:
        for cp in range(F.CP):
            e = ck.entries[F.opt_key(state, cp)]
            assert e.shape == (F.UNPADDED,) and _boxes(e) == want
    assert ck.entries[F.PBN].kind == BYTES
    assert set(ck.data_files) == {f"__{r}_0.distcp" for r in range(F.WORLD)}
    assert not ck.notes


def test_chunks_decode_to_the_saved_values(ckpts: Path):
    ck = open_checkpoint(ckpts / "good" / "iter_0000010")
    e = ck.entries[F.opt_key("exp_avg", 1)]
    full = torch.full((F.UNPADDED,), float("nan"))
    for c in e.chunks:
        full[c.offsets[0]:c.offsets[0] + c.sizes[0]] = load_chunk(ck, e, c)
    assert torch.equal(full, F.opt_values("exp_avg", 1))
    assert load_object(ck, ck.entries[F.PBN_UNPADDED]) == [[{(torch.bfloat16, torch.float32): [F.UNPADDED]}]]
    # verify decodes the same object without torch: dtypes come back as the format's DType entries
    assert load_plain(ck, ck.entries[F.PBN_UNPADDED]) == [[{(DTYPES["bfloat16"], DTYPES["float32"]): [F.UNPADDED]}]]


def test_aliased_save_keeps_one_chunk_per_offset(ckpts: Path):
    ck = open_checkpoint(ckpts / "aliased")
    for state in F.STATES:
        e = ck.entries[F.opt_key(state, None)]
        # both CP peers wrote every offset; DCP kept exactly one copy of each
        assert _boxes(e) == sorted(((s,), (n,)) for spans in F.OPT_CHUNKS.values() for s, n in spans)
        for c in e.chunks:
            rank = writer_rank(c.storage.file)
            cp = rank % F.CP
            got = load_chunk(ck, e, c)
            assert torch.equal(got, F.opt_values(state, cp)[c.offsets[0]:c.offsets[0] + c.sizes[0]])
    # the default DCP planner wraps byte objects once more; the reader undoes that
    assert load_object(ck, ck.entries[F.PBN]) == [[{(torch.bfloat16, torch.float32): [F.PADDED]}]]
    assert load_plain(ck, ck.entries[F.PBN]) == [[{(DTYPES["bfloat16"], DTYPES["float32"]): [F.PADDED]}]]
    report = aliasing(ck, classify_all(ck), topology_view(ck.manifest, None))
    assert report.status == "aliased" and len(report.aliased) == len(F.STATES)
    assert all(s.cp_rank == s.rank % F.CP for a in report.aliased for s in a.survivors)


def test_safetensors_model_matches_torch_dist(ckpts: Path):
    st = open_checkpoint(ckpts / "st")
    assert st.layout == "safetensors" and st.encoding == ENC_RAW and st.metadata_file is None
    td = open_checkpoint(ckpts / "good")
    assert st.entries[F.QKV].shape == td.entries[F.QKV].shape and _boxes(st.entries[F.QKV]) == _boxes(td.entries[F.QKV])
    e = st.entries[F.opt_key("param", 0)]
    assert _boxes(e) == [((0,), (11,)), ((11,), (11,))]
    whole = torch.cat([load_chunk(st, e, c) for c in sorted(e.chunks, key=lambda c: c.offsets)])
    assert torch.equal(whole, F.opt_values("param", 0))
    assert torch.equal(load_chunk(st, st.entries[F.NORM], st.entries[F.NORM].chunks[0]), F.norm_values())


def test_safetensors_multi_chunk_rank_keeps_only_the_last(ckpts: Path):
    e = open_checkpoint(ckpts / "st_lossy").entries[F.opt_key("param", 0)]
    assert _boxes(e) == [((9,), (3,)), ((18,), (4,))]  # each rank's last chunk only


def test_safetensors_reader_uses_no_pickle(ckpts: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(*a, **k):
        raise AssertionError("pickle used")

    for name in ("load", "loads", "Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    ck = open_checkpoint(ckpts / "st")
    e = ck.entries[F.QKV]
    assert torch.equal(load_chunk(ck, e, e.chunks[0]), F.qkv_values()[:8])


def test_locate_errors(tmp_path: Path, ckpts: Path, copy_ckpt):
    run = copy_ckpt("good")
    (run / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(FormatError, match="iter_0000012 is missing"):
        open_checkpoint(run)
    (run / "latest_checkpointed_iteration.txt").write_text("ten")
    with pytest.raises(FormatError, match="not an iteration number"):
        open_checkpoint(run)
    (run / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(FormatError, match="pass one of them"):
        open_checkpoint(run)


def test_gtp_safetensors_layout(ckpts: Path):
    gt = open_checkpoint(ckpts / "gtst")
    assert (gt.layout, gt.backend, gt.metadata_file) == ("safetensors", "gtp safetensors", "index.json")
    assert gt.iteration == F.ITERATION
    td = open_checkpoint(ckpts / "good")
    for key in (F.QKV, F.NORM, *(F.opt_key(s, c) for s in F.STATES for c in range(F.CP))):
        assert _boxes(gt.entries[key]) == _boxes(td.entries[key])
        assert gt.entries[key].dtype == td.entries[key].dtype
        for c in gt.entries[key].chunks:
            other = next(o for o in td.entries[key].chunks if o.offsets == c.offsets)
            assert torch.equal(load_chunk(gt, gt.entries[key], c), load_chunk(td, td.entries[key], other))
    assert not gt.notes


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "gtp"


def test_raw_metadata_is_kept_only_when_asked_and_no_data_file_is_read(monkeypatch: pytest.MonkeyPatch):
    """keep_raw_metadata hands the checked records to a rewriter; the model itself is unchanged by it."""
    import os

    from gtp_format.names import DISTCP_RE
    from gtp_format.reader.safe_pickle import MetadataRecord

    read: list[str] = []

    def spy(real):
        def wrapper(fd, *args, **kwargs):
            read.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
            return real(fd, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(os, "read", spy(os.read))
    monkeypatch.setattr(os, "fdopen", spy(os.fdopen))
    plain = open_checkpoint(FIXTURES / "aliased_cp2_g2_dp2")
    kept = open_checkpoint(FIXTURES / "aliased_cp2_g2_dp2", keep_raw_metadata=True)
    assert ".metadata" in read and not [n for n in read if DISTCP_RE.match(n)]  # metadata only, as before
    assert plain.raw_metadata is None and isinstance(kept.raw_metadata, MetadataRecord)
    assert list(kept.raw_metadata.get("state_dict_metadata")) == list(kept.entries)
    assert kept == plain and repr(kept) == repr(plain)  # records take no part in comparisons or repr
    assert open_checkpoint(FIXTURES / "fold_cp2_g2_dp2_st", keep_raw_metadata=True).raw_metadata is None
