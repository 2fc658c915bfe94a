"""Every ``ckpt`` command's SRC and DST, and the launcher's ``--save``/``--load``, go through the one
location parser: a URL is refused in one line (exit 2) and never becomes a local folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_helpers import REPO

from ckpt_tool.cli import run

# (argv with {url} where a location goes, the argument's name in the message)
COMMANDS = [
    (["inspect", "{url}"], "PATH"),
    (["verify", "{url}"], "PATH"),
    (["verify", "{url}", "--data"], "PATH"),
    (["show", "{url}", "some.key"], "PATH"),
    (["plan", "{url}"], "PATH"),
    (["diff", "{url}", "runs/b"], "A"),
    (["diff", "runs/a", "{url}"], "B"),
    (["reshard", "{url}", "out"], "SRC"),
    (["reshard", "runs/a", "{url}"], "DST"),
    (["export", "{url}", "out", "--to", "hf"], "SRC"),
    (["export", "runs/a", "{url}", "--to", "hf"], "DST"),
    (["migrate-aliased", "{url}", "out"], "SRC"),
    (["migrate-aliased", "runs/a", "{url}"], "DST"),
    (["import", "{url}", "out", "--from", "hf"], "SRC"),
    (["import", "hf_in", "{url}", "--from", "hf"], "DST"),
    (["verify-roundtrip", "{url}"], "PATH"),
]
URLS = [("s3:/bucket/run", "two slashes"),
        ("gs://bucket/run", "gs:// is not supported"),
        ("file:///tmp/run", "file:// URLs are not taken")]


# Commands that read a checkpoint from a bucket or write one into it (tests/s3/): only their unsupported
# URLs are refused here.
READS_BUCKETS = {("inspect", "PATH"), ("verify", "PATH"), ("show", "PATH"), ("diff", "A"), ("diff", "B"),
                 ("plan", "PATH"), ("export", "SRC"), ("export", "DST"), ("reshard", "SRC"), ("reshard", "DST"),
                 ("migrate-aliased", "DST"), ("import", "DST"), ("verify-roundtrip", "PATH"), ("import", "SRC"),
                 ("migrate-aliased", "SRC")}
CASES = [(argv, name, url, words) for argv, name in COMMANDS for url, words in URLS
         if not (url.startswith("s3://") and (argv[0], name) in READS_BUCKETS)]


@pytest.mark.parametrize(("argv", "name", "url", "words"), CASES,
                         ids=[f"{' '.join(a)} {u}" for a, _, u, _ in CASES])
def test_every_command_refuses_urls(argv, name, url, words, tmp_path, monkeypatch, capsys):
    """Through ``ckpt``'s own entry point (a usage error: one line, not Typer's box)."""
    monkeypatch.chdir(tmp_path)
    assert run([a.replace("{url}", url) for a in argv]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ckpt: error: Invalid value for '{name.lower()}': "), out.err
    assert words in lines[0] and out.out == ""
    assert list(tmp_path.iterdir()) == []  # no folder named after the URL (s3:/bucket/run)


@pytest.mark.parametrize(("flag", "url", "words"), [
    ("--save", "gs://bucket/run --async-save", "gs:// is not supported"),
    ("--load", "s3://Bucket/run", "not a bucket name"),
    ("--save", "s3:/bucket/run", "two slashes"),
    ("--save", "msc://profile/run", "msc:// is not supported"),
])
def test_launcher_refuses_urls(flag, url, words, tmp_path):
    """Through the real launcher, in an empty working directory: exit 2, one line, nothing created there."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "gtp_runtime.train", "--steps", "1", flag, *url.split()], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} ") and words in lines[0], p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


def test_every_command_takes_a_bucket_where_it_takes_a_checkpoint():
    """No SRC, DST or PATH is local-only any more (tests/s3/ runs each on a bucket)."""
    assert {(argv[0], name) for argv, name in COMMANDS} == READS_BUCKETS
