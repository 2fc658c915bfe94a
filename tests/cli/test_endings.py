"""Every ending says what happened (issue 27): ``verify`` lists only the checks that ran, counts
in words ("1 warning", not "1 warnings"), and ``inspect`` gives the data position as words."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cli_helpers import cli

from ckpt_tool.output import count
from ckpt_tool.report_tables import data_position_words

REPO = Path(__file__).resolve().parents[2]
MEGATRON = REPO / "fixtures" / "megatron" / "tp2_dp2_dp_reshardable"
FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
MANIFEST_CHECKS = {"manifest_keys", "param_optimizers", "manifest_files"}


def test_verify_without_a_manifest_lists_no_manifest_check() -> None:
    r = cli("verify", MEGATRON, "--format", "json")
    assert r.exit_code == 0, r.stderr
    assert not MANIFEST_CHECKS & set(json.loads(r.stdout)["checks"])
    table = cli("verify", MEGATRON)
    assert "checks that ran: metadata, geometry, storage, optimizer, bucket_numel)" in table.stdout, table.stdout
    with_manifest = json.loads(cli("verify", FOLD, "--format", "json").stdout)["checks"]
    assert MANIFEST_CHECKS <= set(with_manifest)


def test_counts_are_singular_or_plural() -> None:
    assert (count(1, "warning"), count(0, "error"), count(2, "file")) == ("1 warning", "0 errors", "2 files")
    out = cli("verify", FOLD).stdout
    assert not re.search(r"\b1 (errors|warnings|keys|chunks|files)\b", out), out


def test_data_position_is_words_not_a_dict() -> None:
    position = {"consumed_train_samples": 40, "path": "data/corpus",
                "dataset": {"name": "corpus", "dtype": "uint16", "sequences": 12, "documents": 12, "tokens": 9000,
                            "split": "98,2", "seed": 1234}}
    text = data_position_words(position)
    assert text == ("40 samples consumed; of corpus (12 documents, 9000 tokens, 12 sequences), dtype uint16, "
                    "split 98,2, seed 1234; read from data/corpus")
    assert "{" not in data_position_words({"consumed_train_samples": 1, "dataset": {"a": {"b": [1, 2]}}})
    assert "default corpus" in data_position_words({"consumed_train_samples": 0, "path": None})
