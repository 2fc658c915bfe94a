"""Megatron-LM's flag names work as aliases, every flag has help and shows its default, and the
vocabulary size comes from the tokenizer file next to a prepared dataset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gtp_runtime import train

# Megatron's name, the value given, our dest and the value it must take (names from Megatron-LM's
# megatron/training/arguments.py).
MEGATRON = [
    ("--tensor-model-parallel-size", "2", "tp", 2),
    ("--context-parallel-size", "2", "cp", 2),
    ("--train-iters", "7", "steps", 7),
    ("--micro-batch-size", "3", "micro_batch", 3),
    ("--global-batch-size", "6", "global_batch_size", 6),
    ("--hidden-size", "32", "hidden", 32),
    ("--ffn-hidden-size", "96", "ffn_hidden", 96),
    ("--num-layers", "3", "num_layers", 3),
    ("--num-attention-heads", "2", "num_heads", 2),
    ("--seq-length", "16", "seq_length", 16),
    ("--vocab-size", "128", "vocab_size", 128),
    ("--num-experts", "2", "num_experts", 2),
    ("--moe-router-topk", "2", "moe_topk", 2),
    ("--ckpt-format", "safetensors", "ckpt_layout", "safetensors"),
    ("--ddp-bucket-size", "1000", "bucket_size", 1000),
    ("--lr", "0.002", "lr", 0.002),
    ("--min-lr", "1e-5", "min_lr", 1e-5),
    ("--lr-warmup-iters", "2", "lr_warmup_iters", 2),
    ("--lr-decay-iters", "9", "lr_decay_iters", 9),
    ("--lr-decay-style", "cosine", "lr_decay_style", "cosine"),
    ("--weight-decay", "0.1", "weight_decay", 0.1),
    ("--clip-grad", "0.5", "clip_grad", 0.5),
    ("--seed", "7", "seed", 7),
    ("--split", "9,1", "split", "9,1"),
    ("--data-path", "d/x", "data_path", "d/x"),
    ("--eval-interval", "2", "eval_interval", 2),
    ("--eval-iters", "3", "eval_iters", 3),
    ("--save", "ckpt", "save", "ckpt"),
    ("--save-interval", "2", "save_interval", 2),
    ("--load", "ckpt", "load", "ckpt"),
    ("--optimizer", "muon", "optimizer", "muon"),
    ("--muon-momentum", "0.9", "muon_momentum", 0.9),
]


@pytest.mark.parametrize(("flag", "value", "dest", "expected"), MEGATRON, ids=[m[0] for m in MEGATRON])
def test_megatron_name_sets_our_flag(flag: str, value: str, dest: str, expected: object) -> None:
    args = train.build_parser().parse_args([flag, value])
    assert getattr(args, dest) == expected
    assert getattr(train.build_parser().parse_args([]), dest) != expected


def test_megatron_command_line_resolves_like_ours() -> None:
    ours = ["--nproc-per-node", "4", "--tp", "2", "--cp", "2", "--steps", "3", "--micro-batch", "1",
            "--hidden", "32", "--ffn-hidden", "64", "--num-heads", "2"]
    megatron = ["--nproc-per-node", "4", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                "--train-iters", "3", "--micro-batch-size", "1", "--global-batch-size", "1", "--hidden-size", "32",
                "--ffn-hidden-size", "64", "--num-attention-heads", "2"]
    a, b = train.build_parser().parse_args(ours), train.build_parser().parse_args(megatron)
    cfg_a, world_a = train.resolve(a, None)
    cfg_b, world_b = train.resolve(b, None)
    train.refuse_impossible(b, cfg_b)
    assert (cfg_a, world_a, a.steps) == (cfg_b, world_b, b.steps)


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = train.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        assert action.help, f"{action.option_strings} has no help"
        if not isinstance(action, argparse._StoreTrueAction):
            assert "default:" in parser._get_formatter()._get_help_string(action), action.option_strings
    assert "(default: 1)" in text and "(default: 40000000)" in text and "(default: off)" in text


def test_vocab_size_comes_from_the_tokenizer_next_to_the_data(tmp_path: Path) -> None:
    prefix = tmp_path / "corpus"
    vocab = {chr(65 + i): i + 1 for i in range(40)}
    (tmp_path / "corpus.tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": vocab}, "added_tokens": [{"id": 0, "content": "<|endoftext|>"}]}))
    cfg, _ = train.resolve(train.build_parser().parse_args(["--data-path", str(prefix)]), None)
    assert cfg.model.vocab_size == 41
    cfg, _ = train.resolve(train.build_parser().parse_args(["--data-path", str(prefix), "--vocab-size", "64"]), None)
    assert cfg.model.vocab_size == 64, "an explicit --vocab-size wins"
    cfg, _ = train.resolve(train.build_parser().parse_args(["--data-path", str(tmp_path / "other")]), None)
    assert cfg.model.vocab_size == train.DEFAULT_VOCAB


def test_a_broken_tokenizer_file_is_one_line_naming_it(tmp_path: Path) -> None:
    from gtp_runtime.data.indexed import DataError

    (tmp_path / "c.tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match=r"c\.tokenizer\.json(: not a tokenizers JSON file| is not valid JSON)"
                                        r".*pass --vocab-size"):
        train.resolve(train.build_parser().parse_args(["--data-path", str(tmp_path / "c")]), None)


def test_tokenizer_from_prepare_gives_its_size(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from gtp_runtime.data.prepare import main as prepare

    src = tmp_path / "a.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    assert prepare(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer", "bpe",
                    "--vocab-size", "300"]) == 0
    size = Tokenizer.from_file(str(tmp_path / "d.tokenizer.json")).get_vocab_size()
    cfg, _ = train.resolve(train.build_parser().parse_args(["--data-path", str(tmp_path / "d")]), None)
    assert cfg.model.vocab_size == size
