"""The one location parser: a URL is never a local path, a bad URL is one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gtp_format.errors import EXIT_BAD_INPUT
from gtp_format.storage.location import LocationError, ObjectURL, local_path, parse_location


@pytest.mark.parametrize(("text", "bucket", "prefix"), [
    ("s3://bucket/run", "bucket", "run"),
    ("s3://my.bucket-1/a/b/iter_0000003/", "my.bucket-1", "a/b/iter_0000003"),
    ("S3://bkt", "bkt", ""),
])
def test_object_urls(text, bucket, prefix):
    loc = parse_location(text, "SRC")
    assert loc == ObjectURL("s3", bucket, prefix)
    assert parse_location(str(loc)) == loc  # printed back as it parses
    assert loc.key("x.distcp") == "/".join(p for p in (prefix, "x.distcp") if p)


@pytest.mark.parametrize(("text", "words"), [
    ("gs://bucket/run", ["SRC 'gs://bucket/run'", "gs:// is not supported", "./gs://bucket/run"]),
    ("msc://profile/run", ["msc:// is not supported"]),
    ("file:///tmp/run", ["file:// URLs are not taken"]),
    ("s3:/bucket/run", ["two slashes", "./s3:/bucket/run"]),
    ("s3:///run", ["two slashes"]),
    ("s3://-x-/run", ["'-x-' is not a bucket name"]),
    ("s3://Bucket/run", ["'Bucket' is not a bucket name"]),
    ("s3://b/run", ["'b' is not a bucket name"]),
    ("s3://bucket/a/../b", ["component '..'"]),
    ("s3://bucket/a//b", ["component ''"]),
    ("s3://bucket/a/./b", ["component '.'"]),
    ("s3://bucket/a\\b", ["component"]),
    ("s3://bucket/a\nb", ["component"]),
])
def test_refused_in_one_line(text, words):
    with pytest.raises(LocationError) as e:
        parse_location(text, "SRC")
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert "\n" not in e.value.message
    for w in words:
        assert w in e.value.message


@pytest.mark.parametrize("text", ["runs/x", "/abs/run", "./s3:/bucket/run", "run:1", "a/b://c", "C:run"])
def test_local_paths(text):
    assert parse_location(text) == Path(text)
    assert local_path(text) == Path(text)


def test_local_path_refuses_a_supported_url():
    with pytest.raises(LocationError, match=r"^DST s3://bucket/run: no buckets here$"):
        local_path("s3://bucket/run", "DST", "no buckets here")


@given(scheme=st.from_regex(r"[A-Za-z][A-Za-z0-9+.-]{0,8}", fullmatch=True), slashes=st.integers(1, 4),
       rest=st.text(max_size=40))
def test_a_scheme_is_never_a_local_path(scheme, slashes, rest):
    """Brute force over any ``NAME:/...``: it is an ObjectURL of a supported scheme or refused, never a Path
    (``Path('s3://b/r')`` is the local ``s3:/b/r`` that the old launcher created)."""
    text = f"{scheme}:{'/' * slashes}{rest}"
    try:
        loc = parse_location(text)
    except LocationError:
        return
    assert isinstance(loc, ObjectURL) and scheme.lower() == "s3" and slashes == 2
    assert all(p not in ("", ".", "..") for p in loc.prefix.split("/") if loc.prefix)
