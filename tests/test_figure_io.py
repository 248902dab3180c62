"""Saving figures (`art_analysis.plots.figure_io`): a PNG and its PDF land together or not at all, and the runnable
figure modules' command lines."""
from __future__ import annotations

import os
import stat

import matplotlib.pyplot as plt
import pytest

from art_analysis.plots import ablation
from art_analysis.plots.figure_io import save_figure


def _figure():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    return fig


def test_a_png_and_its_pdf_are_written_with_the_umask_and_no_temporary_file(tmp_path):
    mask = os.umask(0o022)
    try:
        assert save_figure(_figure(), tmp_path / "a.png") == tmp_path / "a.png"
    finally:
        os.umask(mask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf", "a.png"]
    assert stat.S_IMODE((tmp_path / "a.png").stat().st_mode) == 0o644
    assert (tmp_path / "a.pdf").read_bytes().startswith(b"%PDF")


def test_a_failed_pdf_leaves_the_earlier_png_and_no_temporary_file(tmp_path):
    save_figure(_figure(), tmp_path / "a.png")
    before = (tmp_path / "a.png").read_bytes()
    (tmp_path / "a.pdf").unlink()
    (tmp_path / "a.pdf").mkdir()                      # the PDF cannot replace a folder
    with pytest.raises(OSError):
        save_figure(_figure(), tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf", "a.png"]


@pytest.mark.parametrize("name", ["figure", "figure.tmp", "figure.docx"])
def test_a_path_without_a_figure_format_is_named(name, tmp_path):
    with pytest.raises(ValueError, match=f"a figure path must end in one of .*got '.*{name}'"):
        save_figure(_figure(), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_a_demo_module_draws_only_when_asked_and_into_its_out_folder(tmp_path, monkeypatch, capsys):
    drawn = []
    monkeypatch.setattr(ablation, "_draw_demo", drawn.append)
    with pytest.raises(SystemExit) as exit_:
        ablation.main(["--help"])
    assert exit_.value.code == 0 and drawn == [] and "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        ablation.main(["--bogus"])
    assert exit_.value.code == 2 and drawn == []
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SystemExit):
        ablation.main(["--out", str(a_file)])
    assert f"--out {str(a_file)!r} is not a folder" in capsys.readouterr().err and drawn == []
    assert ablation.main(["--out", str(tmp_path / "demo")]) == 0 and drawn == [tmp_path / "demo"]
