"""The walk-persistence figure: one point per walk pair, one line per layer, one dashed line per threshold."""
from __future__ import annotations

import json

import torch

from art_analysis.analysis.walk_persistence import persistence_summary
from art_analysis.plots.walk_persistence import main, walk_persistence_figure


def _result(walks: torch.Tensor, thresholds=()) -> dict:
    return {"model": "smollm2", "context_tokens": 640, "dtype": "bfloat16", "walks": walks.tolist(),
            "summary": persistence_summary(walks, thresholds)}


def test_figure_draws_every_walk_pair_every_layer_and_every_threshold():
    walks = torch.tensor([[[[10, 20]], [[10, 25]], [[12, 25]]],
                          [[[30, 5]], [[28, 6]], [[40, 6]]]])
    result = _result(walks, thresholds=[26, 25])
    fig = walk_persistence_figure(result)
    pairs_ax, longest_ax = fig.axes
    points = pairs_ax.collections[0].get_offsets()
    assert points.tolist() == [[10, 10], [20, 25], [10, 12], [25, 25], [30, 28], [5, 6], [28, 40], [6, 6]]
    layer_lines = [line for line in longest_ax.lines if line.get_linestyle() == "-"]
    assert [line.get_ydata().tolist() for line in layer_lines] == [[20, 25, 25], [30, 28, 40]]
    dashed = [line for line in longest_ax.lines if line.get_linestyle() == "--"]
    assert sorted(line.get_ydata()[0] for line in dashed) == [25, 26]
    assert f"rank correlation {result['summary']['rank_correlation']:.2f}" in pairs_ax.get_title()


def test_module_writes_the_figure_from_the_analysis_json(tmp_path):
    walks = torch.full((1, 2, 1, 3), 11)   # whole walks: no rank correlation
    source = tmp_path / "persistence.json"
    source.write_text(json.dumps(_result(walks)))
    assert main([str(source), "--out", str(tmp_path / "walks.png")]) == 0
    assert (tmp_path / "walks.png").stat().st_size > 0 and (tmp_path / "walks.pdf").stat().st_size > 0
    fig = walk_persistence_figure(_result(walks))
    assert "undefined" in fig.axes[0].get_title()
