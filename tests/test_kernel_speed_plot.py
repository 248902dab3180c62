"""The decode speed figure's paged panel: one bar per call and page size at its time over the contiguous layout's."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from art_analysis.plots.kernel_speed import dense_batches_panel, kernel_speed_figure, paged_panel  # noqa: E402


def _paged_rows():
    rows = []
    for batch, seqlen in ((8, 32768), (128, 8192)):
        for impl in ("art_dense", "art"):
            rows.append(dict(impl=impl, batch=batch, seqlen=seqlen, page_size=None, ms=1.0, over_contiguous=1.0))
            for size in (16, 64):
                rows.append(dict(impl=impl, batch=batch, seqlen=seqlen, page_size=size, ms=1.0,
                                 over_contiguous=round(1 + size / 100 + (impl == "art") + batch / 1000, 3)))
    rows.append(dict(impl="art", batch=1, seqlen=8192, page_size=16, error="no kernel"))  # untimed: left out
    return rows


def test_paged_panel_draws_each_calls_time_over_the_contiguous_layouts():
    fig, ax = plt.subplots()
    paged_panel(ax, _paged_rows())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["128 x 8k", "8 x 32k"]  # shorter sequences first
    drawn = {container.get_label(): [round(bar.get_height(), 3) for bar in container] for container in ax.containers}
    assert drawn == {"dense, pages of 16": [1.288, 1.168], "dense, pages of 64": [1.768, 1.648],
                     "ART, pages of 16": [2.288, 2.168], "ART, pages of 64": [2.768, 2.648]}
    plt.close(fig)


def _dense_batch_rows():
    rows = []
    for seqlen in (8192, 32768):
        for batch in (18, 6):
            rows.append(dict(batch=batch, seqlen=seqlen, impl="cudnn_sdpa", ms=1.0, speedup_vs_best_peer=1.0))
            rows.append(dict(batch=batch, seqlen=seqlen, impl="art_dense", ms=1.0,
                             speedup_vs_best_peer=batch / 20 + seqlen / 2 ** 20))
            rows.append(dict(batch=batch, seqlen=seqlen, impl="art_dense_bs64_one_wave", ms=1.0,
                             speedup_vs_best_peer=1.0 + batch / 100))
    rows.append(dict(batch=2, seqlen=8192, impl="art_dense", error="out of memory"))   # untimed: left out
    return rows


def test_dense_batches_panel_draws_each_plan_over_the_best_peer_against_the_batch():
    fig, ax = plt.subplots()
    dense_batches_panel(ax, _dense_batch_rows())
    drawn = {line.get_label(): (list(line.get_xdata()), [round(y, 4) for y in line.get_ydata()])
             for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert drawn == {"8k, default plan": ([6, 18], [0.3078, 0.9078]),
                     "8k, 64-token blocks, one wave": ([6, 18], [1.06, 1.18]),
                     "32k, default plan": ([6, 18], [0.3312, 0.9312]),
                     "32k, 64-token blocks, one wave": ([6, 18], [1.06, 1.18]),
                     "target 0.97x": ([0, 1], [0.97, 0.97])}
    plt.close(fig)


def test_the_figure_adds_the_dense_batches_and_paged_panels_only_when_the_results_have_their_rows():
    rows = [dict(data="synthetic", batch=8, seqlen=seqlen, impl="art_dense", ms=1.0, tb_per_s=4.0)
            for seqlen in (8192, 32768)]
    results = {"rows": rows, "copy_ceiling_tb_per_s": 4.2, "device": "test", "date": "2026-12-02"}
    titles = []
    for extra in ({"paged": []}, {"paged": _paged_rows()},
                  {"dense_batches": _dense_batch_rows(), "paged": _paged_rows()}):
        fig = kernel_speed_figure({**results, **extra})
        titles.append([ax.get_title() for ax in fig.axes])
        plt.close(fig)
    assert titles == [["S = 8k", "S = 32k", "ART: time against traffic"],
                      ["S = 8k", "S = 32k", "paged layout (shuffled pages)", "ART: time against traffic"],
                      ["S = 8k", "S = 32k", "dense, batches between the grid's", "paged layout (shuffled pages)",
                       "ART: time against traffic"]]


def test_the_title_says_how_the_run_emptied_the_l2():
    rows = [dict(data="synthetic", batch=8, seqlen=8192, impl="art_dense", ms=1.0, tb_per_s=4.0)]
    results = {"rows": rows, "copy_ceiling_tb_per_s": 4.2, "device": "test", "date": "2026-12-02"}
    titles = []
    for extra in ({"l2_flush": "read"}, {}):       # runs before the key was written used do_bench's memset
        fig = kernel_speed_figure({**results, **extra})
        titles.append(fig._suptitle.get_text())
        plt.close(fig)
    assert "L2 emptied by a read" in titles[0]
    assert "L2 emptied by do_bench's memset" in titles[1]
