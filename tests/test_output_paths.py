"""The commands check where they write before their work starts, and say why a location will not do."""
from __future__ import annotations

from pathlib import Path

import pytest

from art_analysis.cli import main
from art_analysis.cli.output_paths import check_output_file, check_output_folder


def test_a_missing_folder_is_made_with_its_parents(tmp_path):
    folder = tmp_path / "a" / "b"
    assert check_output_folder(folder, "--out") == folder and folder.is_dir()
    assert check_output_file(tmp_path / "c" / "rows.json", "--json") == tmp_path / "c" / "rows.json"
    assert (tmp_path / "c").is_dir() and not (tmp_path / "c" / "rows.json").exists()
    assert check_output_file(None, "--json") is None


def test_a_file_where_a_folder_must_be_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match="--out '.*taken' exists and is not a folder"):
        check_output_folder(tmp_path / "taken", "--out")
    with pytest.raises(ValueError, match=r"--out '.*taken/x': cannot make the folder \(Not a directory\)"):
        check_output_folder(tmp_path / "taken" / "x", "--out")
    with pytest.raises(ValueError, match="--json '.*' is a folder; give a file name"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(ValueError, match="--json '.*taken/rows.json': its folder '.*taken' exists and is not a folder"):
        check_output_file(tmp_path / "taken" / "rows.json", "--json")
    # a path ending in .. names a folder, even where that does not exist yet: no folder is made for it
    with pytest.raises(ValueError, match=r"--json '.*missing/\.\.' names no file"):
        check_output_file(tmp_path / "missing" / "..", "--json")
    assert not (tmp_path / "missing").exists()


def test_a_folder_without_write_permission_is_refused(tmp_path, monkeypatch):
    import art_analysis.cli.output_paths as output_paths

    locked = tmp_path / "locked"
    locked.mkdir()
    # root may write anywhere, so the permission is denied through the check the module makes
    monkeypatch.setattr(output_paths.os, "access", lambda path, mode: Path(path) != locked)
    with pytest.raises(ValueError, match="cannot write in the folder"):
        check_output_folder(locked, "--out")
    check_output_folder(tmp_path, "--out")


def test_a_command_refuses_its_output_before_any_work(tmp_path, capsys, monkeypatch):
    import art_analysis.cli.figures as figures
    import art_analysis.cli.simulate as simulate
    import art_analysis.models as models

    def no_work(*args, **kwargs):
        raise AssertionError("the work started before the output was checked")

    monkeypatch.setattr(figures, "synthetic_cache", no_work)
    monkeypatch.setattr(simulate, "_inputs", no_work)
    monkeypatch.setattr(models, "load_model", no_work)
    (tmp_path / "taken").write_text("")
    assert main(["figures", "--synthetic", "realistic", "--out", str(tmp_path / "taken" / "figs")]) == 2
    assert main(["simulate", "--synthetic", "realistic", "--json", str(tmp_path)]) == 2
    assert main(["capture", "--context", "128", "--out", str(tmp_path / "taken" / "capture")]) == 2
    err = capsys.readouterr().err
    assert "art-analysis figures: error: --out" in err and "cannot make the folder" in err
    assert "art-analysis simulate: error: --json" in err and "is a folder; give a file name" in err
    assert "art-analysis capture: error: --out" in err and "its parent" in err and "is not a folder" in err


def test_a_command_that_runs_out_of_memory_says_so_and_other_errors_still_raise(capsys, monkeypatch):
    import art_analysis.cli.simulate as simulate

    def fail_with(exc):
        def run(args):
            raise exc
        return run

    monkeypatch.setattr(simulate, "run", fail_with(RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 40000000000000 bytes.")))
    assert main(["simulate", "--synthetic", "realistic"]) == 2
    assert "art-analysis simulate: error: out of memory (" in capsys.readouterr().err
    monkeypatch.setattr(simulate, "run", fail_with(MemoryError()))
    assert main(["simulate", "--synthetic", "realistic"]) == 2
    monkeypatch.setattr(simulate, "run", fail_with(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        main(["simulate", "--synthetic", "realistic"])
