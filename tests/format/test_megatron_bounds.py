"""Issue 22 classes 3 and 5 in the megatron-core layout inference (:mod:`gtp_format.megatron.view`).

A layer count declared in ``.metadata`` must not drive a loop beyond what is stored, and the
inference must cost about what the chunks it reads cost (no per-layer or per-chunk rescans; measured
as a ratio to plain ``inspect`` by the benchmark, see docs/performance.md).
The layouts come from ``benchmarks/bench_megatron_inspect.py``'s generator: megatron-core's GPT
local-spec keys, one chunk per layer, one bucket chunked per parameter slice and alignment gap.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_megatron_inspect import generate  # noqa: E402

from gtp_format.errors import FormatError  # noqa: E402
from gtp_format.megatron.keys import LAYER  # noqa: E402
from gtp_format.megatron.view import megatron_views  # noqa: E402
from gtp_format.reader.checkpoint import open_checkpoint  # noqa: E402


def test_generated_layout_is_the_one_the_rules_derive(tmp_path: Path) -> None:
    generate(tmp_path / "iter_0000001", 3)
    views = megatron_views(open_checkpoint(tmp_path / "iter_0000001"))
    # a dense GPT layer (bench_megatron_inspect's): no router, shared experts or q/k layernorm
    per_layer = len([k for _, k in LAYER if not any(s in k for s in ("router", "shared_experts", "_layernorm."))])
    assert len(views) == 2 + 3 * per_layer + 2
    assert views["decoder.layers.2.mlp.linear_fc2.bias"].layer == 2


@pytest.mark.parametrize("declared", [3, 1000, 10**9])
def test_declared_layer_count_beyond_the_stored_chunks_is_refused_first(tmp_path: Path, declared: int) -> None:
    generate(tmp_path / "iter_0000001", 2, declared=declared)
    ckpt = open_checkpoint(tmp_path / "iter_0000001")
    with pytest.raises(FormatError, match=rf"declares {declared} layers but stores chunks for 2"):
        megatron_views(ckpt)  # refused before any per-layer work: 10^9 layers would run for hours
