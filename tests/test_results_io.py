"""Result files name the input they were measured on by content, not only by its local file name, and the code they
were measured with."""
import hashlib
import json
import math
import os
import stat
import subprocess

import numpy as np
import pandas as pd

from kernels.results_io import SOURCE_COMMIT_ENV, input_file_record, source_revision, write_json_atomic


def test_an_input_file_is_recorded_by_name_size_and_content_hash(tmp_path):
    data = bytes(range(256)) * (10 * 1024 + 3)          # over two read chunks of 1 MiB, and a partial third
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    record = input_file_record(path)
    assert record == {"name": "x.safetensors", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    renamed = tmp_path / "smollm2_layer15.safetensors"
    path.rename(renamed)
    assert input_file_record(renamed)["sha256"] == record["sha256"]
    renamed.write_bytes(data[:-1] + b"\x00")              # one byte changed: another input
    assert input_file_record(renamed)["sha256"] != record["sha256"]


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_a_result_names_the_commit_it_was_measured_with(tmp_path, monkeypatch):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    repo = tmp_path / "repo"
    (repo / "kernels").mkdir(parents=True)
    (repo / "kernels" / "k.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "kernels/k.py")
    _git(repo, "commit", "-q", "-m", "k")
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert source_revision(repo / "kernels") == {"commit": head, "modified": False, "from": "git"}
    (repo / "kernels" / "new.py").write_text("")                  # untracked files do not count
    assert source_revision(repo / "kernels")["modified"] is False
    (repo / "kernels" / "k.py").write_text("x = 2\n")
    assert source_revision(repo / "kernels") == {"commit": head, "modified": True, "from": "git"}
    # a commit named for a copied tree wins over the copy's own history, which need not be the tree's
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "0123abcd")
    assert source_revision(repo / "kernels") == {"commit": "0123abcd", "modified": None, "from": SOURCE_COMMIT_ENV}


def test_a_tree_without_history_takes_the_commit_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above tmp_path is searched
    assert source_revision(tmp_path) == {"commit": None, "modified": None, "from": None}
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "0123abcd")
    assert source_revision(tmp_path) == {"commit": "0123abcd", "modified": None, "from": SOURCE_COMMIT_ENV}


def test_the_report_names_a_result_commit_when_it_has_one():
    from art_analysis.cli.report import _source_note

    note = _source_note({"source": {"commit": "0123456789abcdef", "modified": True}})
    assert note == ", commit 0123456789ab + changes"
    assert _source_note({"source": {"commit": "0123456789abcdef", "modified": None}}) == ", commit 0123456789ab"
    assert _source_note({"source": None}) == _source_note({}) == ""


def _strict_json(text: str):
    """``text`` parsed as standard JSON: the bare tokens NaN and Infinity are refused."""
    def refuse(token):
        raise ValueError(f"not standard JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_result_with_undefined_numbers_is_written_as_standard_json(tmp_path):
    # a summary table as the studies make it: a share over no truncated heads is NaN
    table = pd.DataFrame([dict(rule="a", error_mean=0.25, certified=float("nan")),
                          dict(rule="b", error_mean=np.float64("inf"), certified=0.5)])
    payload = {"rows": table.to_dict("records"), "spread": (1.0, -math.inf), "nested": {"x": [float("nan"), 2]},
               "count": 3, "name": "nan", "flag": True}
    path = write_json_atomic(tmp_path / "result.json", payload)
    read = _strict_json(path.read_text())
    assert read == {"rows": [dict(rule="a", error_mean=0.25, certified=None),
                             dict(rule="b", error_mean=None, certified=0.5)],
                    "spread": [1.0, None], "nested": {"x": [None, 2]}, "count": 3, "name": "nan", "flag": True}
    assert payload["nested"]["x"][0] != payload["nested"]["x"][0]        # the caller's payload is left as it was


def test_a_result_file_takes_the_mode_of_a_plain_write(tmp_path):
    mask = os.umask(0o027)
    try:
        write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640        # not mkstemp's 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
