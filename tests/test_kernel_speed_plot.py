"""The decode speed figure's paged panel: one bar per call and page size at its time over the contiguous layout's."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from art_analysis.plots.kernel_speed import kernel_speed_figure, paged_panel  # noqa: E402


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


def test_the_figure_adds_the_paged_panel_only_when_the_results_have_paged_rows():
    rows = [dict(data="synthetic", batch=8, seqlen=seqlen, impl="art_dense", ms=1.0, tb_per_s=4.0)
            for seqlen in (8192, 32768)]
    results = {"rows": rows, "copy_ceiling_tb_per_s": 4.2, "device": "test", "date": "2026-12-02"}
    titles = []
    for paged in ([], _paged_rows()):
        fig = kernel_speed_figure({**results, "paged": paged})
        titles.append([ax.get_title() for ax in fig.axes])
        plt.close(fig)
    assert titles == [["S = 8k", "S = 32k", "ART: time against traffic"],
                      ["S = 8k", "S = 32k", "paged layout (shuffled pages)", "ART: time against traffic"]]


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
