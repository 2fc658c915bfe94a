"""Size options take units as Hugging Face does: one parser (``ckpt_tool.output.parse_size``)."""

from __future__ import annotations

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st

from ckpt_tool.output import parse_size


@pytest.mark.parametrize("text,want", [
    ("5GB", 5 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("1000000", 10**6), ("20KB", 20_000),
    ("8KiB", 8192), ("2 TB", 2 * 10**12), ("7B", 7), ("0.5MB", 500_000), ("5gib", 5 << 30), (4096, 4096),
])
def test_units(text: str, want: int) -> None:
    assert parse_size(text) == want


@pytest.mark.parametrize("text,needle", [
    ("5Gb", "bits"), ("5mb", "bits"), ("5 GBs", "not a size"), ("-1", "not a size"), ("", "not a size"),
    ("1e9", "not a size"), ("5XB", "not a size"), ("0", "less than"), ("1.5", "not a whole number of bytes"),
    ("0.1MiB", "not a whole number"), ("1.0001KB", "not a whole number"),
])
def test_refusals(text: str, needle: str) -> None:
    with pytest.raises(typer.BadParameter, match=needle):
        parse_size(text)


@given(st.integers(0, 10**6), st.sampled_from([("KB", 10**3), ("MiB", 2**20), ("GB", 10**9), ("TiB", 2**40)]))
def test_integer_sizes_multiply_exactly(n: int, unit: tuple[str, int]) -> None:
    if n == 0:
        with pytest.raises(typer.BadParameter):
            parse_size(f"{n}{unit[0]}")
    else:
        assert parse_size(f"{n}{unit[0]}") == n * unit[1]
