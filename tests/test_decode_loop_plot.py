"""The decode-loop figure: one panel per length, one line per implementation, split counts where they differ."""
from __future__ import annotations

import json

import pytest

from art_analysis.plots.decode_loop import STYLES, decode_loop_figure, main


def _payload() -> dict:
    rows = []
    for step in range(3):
        rows += [{"step": step, "impl": "art_dense", "ms": 2.0},
                 {"step": step, "impl": "art", "ms": 3.0 + step, "num_splits": 1},
                 {"step": step, "impl": "art_previous_step", "ms": 4.0 if step == 0 else 1.5,
                  "num_splits": 1 if step == 0 else 5},
                 {"step": step, "impl": "art_calibrated", "ms": 1.5, "num_splits": 5},
                 {"step": step, "impl": "art_on_demand", "ms": 1.8, "num_splits": 8}]
    summary = {"previous_step_over_dense": 7.0 / 6.0, "default_over_dense": 12.0 / 6.0, "on_demand_over_dense": 0.9}
    return {"suite": "decode-loop", "device": "GPU", "capture": "layer_015.safetensors", "batch": 32,
            "date": "2026-12-02T00:00:00",
            "loops": [{"seqlen": 8192, "rows": rows, "summary": summary},
                      {"seqlen": 32768, "rows": rows[:4], "summary": summary}]}


def test_figure_draws_each_implementation_per_step_and_marks_split_counts_off_the_calibrated_one():
    fig = decode_loop_figure(_payload())
    first, second = fig.axes[:2]
    lines = {line.get_label(): line for line in first.lines}
    labels = {impl: style["label"].format(walks="longest walk") for impl, style in STYLES.items()}
    assert set(lines) == set(labels.values())
    assert lines[labels["art"]].get_ydata().tolist() == [3.0, 4.0, 5.0]
    assert lines[labels["art_previous_step"]].get_ydata().tolist() == [4.0, 1.5, 1.5]
    # the default's three steps and the hint's first step took 1 split where the calibrated call took 5
    assert sorted(text.get_text() for text in first.texts) == ["1 split"] * 4
    assert len(second.lines[0].get_xdata()) == 1
    # a run without on-demand rows (before V48) draws no line for them
    assert labels["art_on_demand"] not in {line.get_label() for line in second.lines}
    assert "loop over dense: 1.17x with the hint, 2.00x without, 0.90x on demand" in first.get_title()
    assert first.get_title().startswith("B = 32, 8k tokens")


def test_loops_of_their_own_batch_told_each_walk_say_so():
    payload = _payload()
    del payload["batch"]
    for loop, batch in zip(payload["loops"], (32, 128)):
        loop["batch"] = batch
    payload["loops"][1]["rows"][2]["pair_walks"] = [[3, 5]]
    fig = decode_loop_figure(payload)
    assert fig.axes[1].get_title().startswith("B = 128, 32k tokens")
    assert "ART, told the previous step's walks" in {line.get_label() for line in fig.axes[0].lines}


def test_hinted_steps_that_took_on_demand_followers_say_so():
    payload = _payload()
    rows = payload["loops"][0]["rows"]
    hinted = [r for r in rows if r["impl"] == "art_previous_step"]
    hinted[2].update(on_demand=True, num_splits=16)
    hinted[1].update(on_demand=False)
    texts = sorted(text.get_text() for text in decode_loop_figure(payload).axes[0].texts)
    # the default's three steps and the hint's first took 1 split; the hint's last step took on-demand followers
    assert texts == ["1 split"] * 4 + ["on demand"]


def test_module_writes_the_figure_from_the_benchmark_json(tmp_path):
    source = tmp_path / "loop.json"
    source.write_text(json.dumps(_payload()))
    assert main([str(source), "--out", str(tmp_path / "loop.png")]) == 0
    assert (tmp_path / "loop.png").stat().st_size > 0 and (tmp_path / "loop.pdf").stat().st_size > 0


@pytest.mark.parametrize("content, message", [
    (None, "is not a file"), ("{", "is not valid JSON"), ("[1]", "holds a list, not a JSON object"),
    (json.dumps({"suite": "flexprefill", "rows": [], "loops": []}), "is a result of the suite 'flexprefill', not "
                                                                     "'decode-loop'"),
])
def test_module_names_a_file_that_is_not_a_decode_loop_result_before_drawing(content, message, tmp_path, capsys):
    source = tmp_path / "loop.json"
    if content is not None:
        source.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        main([str(source), "--out", str(tmp_path / "loop.png")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if content is None else ["loop.json"])
