"""``ckpt diff`` on part of a checkpoint (``--keys`` / ``--ignore``) and bit for bit (``--bitwise``)."""

from __future__ import annotations

import json
from pathlib import Path

import ckpt_factory as F
import pytest
from cli_helpers import assert_error_line, cli

CHANGED = F.opt_key(F.CHANGED_STATE, F.CHANGED_CP)  # the one element good2 sets to NaN


def _doc(*args: object) -> tuple[int, dict]:
    result = cli("diff", *args, "--format", "json")
    return result.exit_code, json.loads(result.stdout)


def test_help_shows_selection_examples():
    out = cli("diff", "--help").stdout
    assert "--keys 'decoder.*'" in out and "--ignore" in out and "--bitwise" in out


def test_keys_and_ignore_select_what_is_compared(ckpts: Path):
    a, b = ckpts / "good", ckpts / "good2"
    code, doc = _doc(a, b)
    assert code == 1 and [d["key"] for d in doc["differences"]] == [CHANGED]
    everything = doc["compared"]
    code, doc = _doc(a, b, "--ignore", CHANGED)
    assert (code, doc["equal"], doc["compared"]) == (0, True, everything - 1)
    assert doc["selection"] == {"keys": [], "ignore": [CHANGED]}
    code, doc = _doc(a, b, "--keys", "decoder.*")
    assert (code, doc["compared"]) == (0, 2)  # the two model weights
    code, doc = _doc(a, b, "--keys", "decoder.*", "--keys", "*exp_avg.cp_rank_1")  # repeatable
    assert (code, doc["compared"], [d["key"] for d in doc["differences"]]) == (1, 3, [CHANGED])
    code, doc = _doc(a, b, "--keys", "optimizer.*", "--ignore", "*.cp_rank_1")  # ignore wins over keys
    assert code == 0 and doc["compared"] == 3 + 2  # cp_rank_0 of each state, both per_bucket_numel objects
    result = cli("diff", a, b, "--keys", "optimizer.*", "--ignore", "*exp_avg_sq*")
    assert_error_line(result, 1, "checkpoints differ", CHANGED)
    assert "--keys 'optimizer.*' --ignore '*exp_avg_sq*'" in result.stdout  # the table says what was compared


def test_ignore_hides_keys_only_on_one_side(ckpts: Path):
    code, doc = _doc(ckpts / "good", ckpts / "aliased")
    assert code == 1 and doc["only_in_a"] and doc["only_in_b"]
    code, doc = _doc(ckpts / "good", ckpts / "aliased", "--ignore", "optimizer.*")
    assert (code, doc["only_in_a"], doc["only_in_b"], doc["differences"]) == (0, [], [], [])


def test_selection_matching_nothing_is_an_error(ckpts: Path):
    result = cli("diff", ckpts / "good", ckpts / "good2", "--keys", "decoder.layers.9*")
    assert_error_line(result, 2, "--keys 'decoder.layers.9*' matches no key of", "ckpt inspect")
    assert result.stdout == ""
    assert_error_line(cli("diff", ckpts / "good", ckpts / "good2", "--ignore", "*"), 2, "matches no key")


def _negate_first_qkv_element(run: Path) -> None:
    """Flip the sign bit of QKV[0, 0] (0.0 -> -0.0) in place, in a raw (safetensors) chunk."""
    from gtp_format.reader.checkpoint import open_checkpoint

    ckpt = open_checkpoint(run)
    entry = ckpt.entries[F.QKV]
    (chunk,) = [c for c in entry.chunks if c.offsets == (0, 0)]
    assert F.qkv_values()[0, 0] == 0.0 and entry.itemsize == 4
    path = ckpt.root / chunk.storage.file
    data = bytearray(path.read_bytes())
    data[chunk.storage.offset + 3] ^= 0x80  # float32, little-endian: the sign is the top bit of byte 3
    path.write_bytes(bytes(data))


def test_bitwise_sees_what_values_do_not(ckpts: Path, copy_ckpt):
    neg = copy_ckpt("gtst")
    _negate_first_qkv_element(neg)
    code, doc = _doc(ckpts / "gtst", neg)
    assert (code, doc["equal"], doc["rule"]) == (0, True, "rtol=0.0, atol=0.0")  # -0.0 == 0.0 as values
    code, doc = _doc(ckpts / "gtst", neg, "--bitwise")
    assert (code, doc["rule"]) == (1, "bitwise")
    (d,) = doc["differences"]
    assert (d["key"], d["mismatches"], d["first_mismatch"], d["max_abs_diff"]) == (F.QKV, 1, [0, 0], 0.0)
    assert _doc(ckpts / "gtst", ckpts / "gtst", "--bitwise")[0] == 0


def test_bitwise_takes_no_tolerance(ckpts: Path):
    assert_error_line(cli("diff", ckpts / "good", ckpts / "good", "--bitwise", "--atol", "1e-3"), 2,
                      "--bitwise compares bits and takes no tolerance")


@pytest.mark.parametrize("args", [(), ("--bitwise",)])
def test_layouts_differ_only_in_chunks(ckpts: Path, args: tuple[str, ...]):
    """torch_dist (3 chunks per DP rank) against safetensors (1): whole tensors compared, equal."""
    code, doc = _doc(ckpts / "good", ckpts / "st", "--ignore", "*per_bucket_numel*", *args)
    assert (code, doc["differences"], doc["only_in_a"]) == (0, [], [])
