"""Round 4 (issue 40), classes 5 and 6: what writers commit and what they delete or promote.

* **A writer commits what its own reader refuses (class 5).** ``ckpt import --from hf`` copied a
  ``config.json`` value into the manifest (``model.seq_length`` 2**63, over the manifest's 2**62)
  and exited 0 with a checkpoint that ``--load`` and ``verify-roundtrip`` refuse. The one writer
  now reads its finished work folder back through the gate before it commits: one line, exit 2,
  nothing at DST.
* **Deleting or promoting by name (class 6).** A folder merely *named* like a dead writer's work
  folder was deleted with its contents by the next writer into its parent; recovery promoted a
  hidden copy of unknown owner, or of another iteration, with only a warning. Now a work folder
  proves its owner by a token the writer put inside (its hash is in the name); cleanup removes only
  proven folders, and recovery promotes only a proven, finished copy of the marker's iteration, and
  otherwise refuses in one line naming the copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_error_line, cli, snapshot
from hf_folder import hf_folder as _hf_folder

from gtp_format import work
from gtp_format.names import LATEST_FILE

REPO = Path(__file__).resolve().parents[2]
FOLD = REPO / "fixtures" / "gtp" / "fold_cp2_g2_dp2"
ITER = "iter_0000002"
USER_FILES = {"notes.txt": "my notes, not a checkpoint\n", "data/results.csv": "a,b\n1,2\n"}

# -- class 5 ---------------------------------------------------------------------------------------

def test_the_hf_folder_builder_imports(tmp_path: Path) -> None:
    """The builder's folder is one ``import`` takes (so the refusal below is the value's, not the folder's)."""
    r = cli("import", _hf_folder(tmp_path / "hf"), tmp_path / "dst", "--from", "hf")
    assert r.exit_code == 0, r.stderr
    assert cli("verify", tmp_path / "dst").exit_code == 0


@pytest.mark.parametrize("field,value", [("max_position_embeddings", 2**63), ("max_position_embeddings", 2**62 + 2)])
def test_import_never_commits_a_manifest_its_reader_refuses(tmp_path: Path, field: str, value: int) -> None:
    src = _hf_folder(tmp_path / "hf", **{field: value})
    before = snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    line = assert_error_line(cli("import", src, out / "dst", "--from", "hf"), 2, "nothing was committed",
                             "model.seq_length", str(value))
    assert ".tmp." not in line, line  # names DST, not the hidden work folder
    assert os.listdir(out) == [] and snapshot(src) == before


def test_seq_length_flag_out_of_range_is_refused_before_commit(tmp_path: Path) -> None:
    """The same value from the flag: the same check, the same line."""
    out = tmp_path / "out"
    out.mkdir()
    assert_error_line(cli("import", _hf_folder(tmp_path / "hf"), out / "dst", "--from", "hf", "--seq-length",
                          str(2**63)), 2, "nothing was committed", "model.seq_length")
    assert os.listdir(out) == []


# -- class 6 ---------------------------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _named_like_work(parent: Path, target: str, tag: str = "tmp", token: str | None = None,
                     nonce: str | None = None, content: Path | None = None) -> Path:
    """A folder named exactly as a dead writer of this host names its work folder. ``token``: the
    ownership token inside (its hash in the name unless ``nonce`` says otherwise); ``content``: a
    checkpoint folder copied in, else the user's files."""
    nonce = nonce or hashlib.sha256((token or "user").encode()).hexdigest()[:6]
    path = parent / f".{tag}.{target}.w{work._host_id()}{work._boot_id()}-{_dead_pid()}-1-{nonce}"
    if content is not None:
        shutil.copytree(content, path)
    else:
        for rel, text in USER_FILES.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
    if token is not None:
        (path / work.TOKEN_FILE).write_text(token + "\n")
    return path


@pytest.mark.parametrize("how", ["no_token", "token_not_matching_the_name", "token_not_hex", "token_a_link"])
def test_a_folder_named_like_a_dead_writers_work_folder_survives_the_next_writer(tmp_path: Path, how: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    token = "cd" * 16
    kw = {"no_token": {}, "token_not_matching_the_name": {"token": token, "nonce": "abcdef"},
          "token_not_hex": {"token": "not a token, but 32 characters!!"}, "token_a_link": {}}[how]
    mine = _named_like_work(out, "dst", **kw)
    if how == "token_a_link":  # a token file that is a link to a matching token elsewhere
        elsewhere = tmp_path / "token"
        elsewhere.write_text("user\n")
        os.symlink(elsewhere, mine / work.TOKEN_FILE)
    before = snapshot(mine)
    r = cli("reshard", FOLD, out / "dst", "--dp", "1")  # its writer cleans dead writers' leftovers in out/
    assert r.exit_code == 0, r.stderr
    assert mine.is_dir() and snapshot(mine) == before, sorted(os.listdir(out))
    assert [(w.path, w.state, work.proven(w)) for w in work.leftovers(out)] == [(mine, "dead", False)]


def test_a_proven_dead_writers_work_folder_is_still_cleaned(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    stale = _named_like_work(out, "dst", token="ef" * 16, content=FOLD / ITER)
    assert cli("reshard", FOLD, out / "dst", "--dp", "1").exit_code == 0
    assert not stale.exists() and sorted(os.listdir(out)) == ["dst"]


def test_no_token_is_committed(tmp_path: Path) -> None:
    """The token is the writer's, not the checkpoint's: gone from DST after the commit."""
    assert cli("reshard", FOLD, tmp_path / "dst", "--dp", "1").exit_code == 0
    assert not list(tmp_path.rglob(work.TOKEN_FILE))


def _run_missing(tmp_path: Path, latest: str = "2") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / LATEST_FILE).write_text(latest + "\n")
    return run


@pytest.mark.parametrize("case,words", [
    ("unowned", "nothing proves this tool's writer made it"),
    ("token_not_matching", "nothing proves this tool's writer made it"),
    ("other_iteration", "records iteration 2, not the marker's 5"),
    ("old_copy_only", "'old' copy"),
])
def test_recovery_refuses_a_hidden_copy_it_cannot_trust(tmp_path: Path, case: str, words: str) -> None:
    """The marker names an iteration that is missing; the hidden copy beside it is not a proven, finished
    copy of that iteration: every reader refuses in one line naming it (main read it with a warning)."""
    latest = "5" if case == "other_iteration" else "2"
    run = _run_missing(tmp_path, latest)
    target = f"iter_{int(latest):07d}"
    if case == "unowned":
        copy = _named_like_work(run, target, content=FOLD / ITER)
    elif case == "token_not_matching":
        copy = _named_like_work(run, target, token="12" * 16, nonce="abcdef", content=FOLD / ITER)
    elif case == "other_iteration":  # a proven copy holding iteration 2, under iteration 5's name
        copy = _named_like_work(run, target, token="34" * 16, content=FOLD / ITER)
    else:
        copy = _named_like_work(run, target, tag="old", token="56" * 16, content=FOLD / ITER)
    before = snapshot(run)
    for argv in (["verify", run], ["inspect", run], ["export", run, tmp_path / "hf", "--to", "hf"]):
        assert_error_line(cli(*argv), 2, "cannot stand in", copy.name, words)
    assert snapshot(run) == before and not (tmp_path / "hf").exists()


def test_recovery_promotes_a_proven_finished_copy_of_the_markers_iteration(tmp_path: Path) -> None:
    run = _run_missing(tmp_path)
    copy = _named_like_work(run, ITER, token="78" * 16, content=FOLD / ITER)
    _named_like_work(run, ITER, content=FOLD / ITER)  # an unowned one beside it changes nothing
    doc = json.loads(cli("inspect", run, "--format", "json").stdout)
    assert doc["path"] == str(copy) and doc["iteration"] == 2
    assert cli("verify", run, "--data").exit_code == 0
