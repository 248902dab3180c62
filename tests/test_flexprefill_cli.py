"""The `art-analysis flexprefill` command, its figures, and the synthetic prefill it analyses."""
import json

import pytest
import torch

from art_analysis.cli import main
from art_analysis.flexprefill import QUERY_AWARE, select_blocks
from kernels.bench_flexprefill import KIND_NAMES, structured_prefill, tiled_capture


def test_structured_prefill_heads_get_the_pattern_their_kind_implies():
    q, k, _ = structured_prefill(1, 8, 4, 2048, 64, seed=0, dtype=torch.float32, device="cpu")
    selection = select_blocks(q, k, gamma=0.9, tau=0.1, block_size=64, min_budget=128)
    kinds = [KIND_NAMES[h // 2 % len(KIND_NAMES)] for h in range(8)]
    aware = (selection.pattern[0] == QUERY_AWARE).tolist()
    assert aware == [kind == "topic_blocks" for kind in kinds]


def _bench_rows():
    rows = []
    for n, sdpa in ((32768, 14.0), (65536, 57.0)):
        rows.append({"data": "structured", "seqlen": n, "method": "sdpa", "ms": sdpa})
        for gamma, ms in ((0.9, sdpa / 2), (0.95, sdpa / 1.5)):
            rows.append({"data": "structured", "seqlen": n, "method": "flexprefill", "gamma": gamma, "ms": ms})
    return rows


def test_flexprefill_command_writes_table_figures_and_json(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"suite": "flexprefill", "rows": _bench_rows()}))
    rows_json = tmp_path / "rows.json"
    exported = tmp_path / "prefill.safetensors"
    code = main(["flexprefill", "--heads", "4/2", "--seqlen", "256", "--head-dim", "64", "--block-size", "32",
                 "--min-budget", "32", "--gammas", "0.5,0.9,1.0", "--bench-json", str(bench),
                 "--out", str(tmp_path / "figs"), "--json", str(rows_json), "--export-prefill", str(exported)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "kept_fraction" in printed and "synthetic" in printed
    for name in ("patterns", "kept_vs_gamma", "error_vs_gamma", "latency_vs_gamma"):
        assert (tmp_path / "figs" / f"flexprefill_{name}.png").stat().st_size > 0
    rows = json.loads(rows_json.read_text())
    assert [r["gamma"] for r in rows] == [0.5, 0.9, 1.0]
    assert rows[-1]["kept_fraction"] == pytest.approx(1.0) and rows[-1]["rel_error"] < 1e-6
    assert rows[0]["kept_fraction"] <= rows[1]["kept_fraction"] <= rows[2]["kept_fraction"]
    q, k, v = tiled_capture(exported, 0, 600, device="cpu")
    assert q.shape == (1, 4, 600, 64) and k.shape == v.shape == (1, 2, 600, 64) and q.dtype == torch.bfloat16
    assert torch.equal(q[:, :, 256:512], q[:, :, :256]) and torch.equal(k[:, :, 512:], k[:, :, :88])


def test_flexprefill_command_rejects_bad_input(tmp_path, capsys):
    assert main(["flexprefill", "--heads", "4x2", "--out", str(tmp_path)]) == 2
    assert "--heads must look like" in capsys.readouterr().err
    assert main(["flexprefill", "--heads", "4/2", "--seqlen", "128", "--gammas", "1.5", "--block-size", "32",
                 "--out", str(tmp_path)]) == 2
    assert "each of gammas must lie in (0, 1] (a real number), got 1.5" in capsys.readouterr().err
    assert main(["flexprefill", "--heads", "2/1", "--seqlen", "128", "--block-size", "32", "--out", str(tmp_path),
                 "--bench-json", str(tmp_path / "missing.json")]) == 2
    assert "missing.json is not a file" in capsys.readouterr().err
    assert main(["flexprefill", "--heads", "2/1", "--seqlen", "128", "--block-size", "32", "--layers", "3",
                 "--out", str(tmp_path)]) == 2
    assert "--layers chooses among a capture's prefill layers; pass --capture DIR" in capsys.readouterr().err
    for option, value, message in (("--heads", "3/2", "num_q_heads % num_kv_heads must be 0, got 3 and 2"),
                                   ("--seqlen", "0", "seqlen must be a positive int, got 0"),
                                   ("--seqlen", "4", "seqlen must exceed the 4 sink tokens"),
                                   ("--head-dim", "0", "head_dim must be a positive int, got 0")):
        arguments = {"--heads": "2/1", "--seqlen": "128", "--head-dim": "64", option: value}
        assert main(["flexprefill", *[x for pair in arguments.items() for x in pair], "--block-size", "32",
                     "--out", str(tmp_path)]) == 2
        assert message in capsys.readouterr().err


SMALL_RUN = ["flexprefill", "--heads", "2/1", "--seqlen", "128", "--block-size", "32", "--gammas", "0.9"]


def test_flexprefill_command_checks_the_export_path_before_any_work(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    for path, message in ((tmp_path, "is a folder; give a file name"),
                          (tmp_path / "taken" / "prefill.safetensors", "exists and is not a folder")):
        assert main([*SMALL_RUN, "--out", str(tmp_path / "figs"), "--json", str(tmp_path / "rows.json"),
                     "--export-prefill", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--export-prefill '{path}" in err and message in err
    assert not any((tmp_path / "figs").iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["figs", "taken"]


def test_a_failed_export_leaves_no_temporary_file(tmp_path, monkeypatch):
    from art_analysis.cli import flexprefill

    def failing(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(flexprefill.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        flexprefill._export(tmp_path / "prefill.safetensors", {"q0": torch.zeros(1, 1, 4, 8)})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("payload, message", [
    ({"suite": "decode", "rows": [{"impl": "art", "data": "synthetic", "batch": 1, "seqlen": 4096, "ms": 0.1}]},
     "is a result of the suite 'decode', not 'flexprefill'"),
    ({"rows": _bench_rows()}, "lacks suite"),
    ({"suite": "flexprefill", "rows": [{k: v for k, v in row.items() if k != "gamma"} for row in _bench_rows()]},
     "rows[1] lacks gamma"),
    ({"suite": "flexprefill", "rows": [{"data": "structured", "seqlen": 1024, "ms": 1.0}]}, "rows[0] lacks method"),
])
def test_flexprefill_command_names_a_benchmark_json_it_cannot_draw_before_any_work(payload, message, tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(payload))
    assert main([*SMALL_RUN, "--bench-json", str(bench), "--out", str(tmp_path / "figs")]) == 2
    err = capsys.readouterr().err
    assert f"stored flexprefill result {bench}" in err and message in err
    assert not any((tmp_path / "figs").iterdir())


@pytest.mark.parametrize("layers", [",", ""])
def test_flexprefill_command_refuses_an_empty_layer_list(layers, capsys):
    with pytest.raises(SystemExit):
        main(["flexprefill", "--layers", layers])
    assert f"argument --layers: expected at least one integer, got {layers!r}" in capsys.readouterr().err
