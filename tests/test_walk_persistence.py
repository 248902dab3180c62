"""The walk-persistence study: walks replayed at each decode step's length, and their change between steps."""
from __future__ import annotations

import json
import re

import pytest
import torch
from scipy.stats import spearmanr

from art_analysis.analysis.walk_persistence import decode_walks, main, pair_split_persistence, persistence_summary
from art_analysis.termination import ARTConfig, replay_kernel_walks

CONTEXT = 640
STEPS = 3


@pytest.fixture(scope="module")
def small_capture(loaded, tmp_path_factory):
    from art_analysis.capture import capture_kv
    from art_analysis.corpus import long_text

    text = long_text("stdlib", seed=5, length=CONTEXT, tokenizer=loaded.tokenizer)
    capture = capture_kv(loaded, text=text, context_tokens=CONTEXT, decode_steps=STEPS,
                         source={"name": "stdlib", "seed": 5}, progress=False)
    folder = tmp_path_factory.mktemp("capture") / "small"
    capture.select(layers=[3, 15]).save(folder)
    return folder


def test_summary_of_hand_made_walks():
    # [layers 2, steps 3, B 1, Hkv 2]
    walks = torch.tensor([[[[10, 20]], [[10, 25]], [[12, 25]]],
                          [[[30, 5]], [[28, 6]], [[40, 6]]]])
    summary = persistence_summary(walks, thresholds=[26, 25])
    before = [10, 20, 10, 25, 30, 5, 28, 6]
    after = [10, 25, 12, 25, 28, 6, 40, 6]
    assert summary["rank_correlation"] == pytest.approx(spearmanr(before, after).statistic)
    # changes 0 5 2 0 2 1 12 0
    assert summary["abs_change_median"] == 1.5
    assert summary["abs_change_p90"] == pytest.approx(7.1)
    assert summary["unchanged_fraction"] == 3 / 8
    # each layer's longest walk: 20 25 25 and 30 28 40
    assert summary["longest_rel_change_median"] == pytest.approx((2 / 28 + 5 / 25) / 2)
    assert summary["longest_grew_fraction"] == 0.5
    assert summary["split_choice_agreement"] == {"26": 1.0, "25": 0.75}
    assert (summary["layers"], summary["steps"], summary["walks_per_step"]) == (2, 3, 2)


def test_summary_rejects_what_it_cannot_compare():
    with pytest.raises(ValueError, match="steps >= 2"):
        persistence_summary(torch.zeros(2, 1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="layers, steps"):
        persistence_summary(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="threshold"):
        persistence_summary(torch.ones(1, 2, 1, 1, dtype=torch.long), thresholds=[0])


def test_decode_walks_replay_each_step_at_its_own_length(small_capture):
    from art_analysis.capture import KVCapture

    capture = KVCapture.load(small_capture)
    rule = ARTConfig(patience=2)
    walks = decode_walks(capture, rule, progress=False)
    assert walks.shape == (2, STEPS, 1, 3) and walks.dtype == torch.int64
    for i, layer in enumerate(capture.layers):
        q, k, v = capture.layer(layer)
        for step in range(STEPS):
            length = CONTEXT + step + 1
            expected = replay_kernel_walks(q[:, :, step], k[:, :, :length], v[:, :, :length], rule)
            assert torch.equal(walks[i, step], expected)
    with pytest.raises(ValueError, match="group='all'"):
        decode_walks(capture, ARTConfig(group="head"), progress=False)
    with pytest.raises(TypeError, match="KVCapture"):
        decode_walks(object(), rule, progress=False)


def test_module_runs_on_a_capture_folder_and_writes_its_json(small_capture, tmp_path, capsys):
    out = tmp_path / "persistence.json"
    summary = main([str(small_capture), "--thresholds", "5", "--dtype", "bfloat16", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["summary"] == summary == json.loads(capsys.readouterr().out)
    assert written["dtype"] == "bfloat16" and torch.tensor(written["walks"]).shape == (2, STEPS, 1, 3)
    assert (written["context_tokens"], written["decode_steps"], written["source"]["seed"]) == (CONTEXT, STEPS, 5)
    assert set(summary["split_choice_agreement"]) == {"5"}
    # 641-643 tokens are 11 blocks, short of ARTConfig()'s earliest stop (17): every walk is whole, so no rank
    assert written["walks"] == [[[[11] * 3]] * STEPS] * 2
    assert summary["rank_correlation"] is None and summary["unchanged_fraction"] == 1.0


def test_pair_split_persistence_of_hand_made_walks():
    # layer 0: the long walk moves from pair 3 to pair 2 and stays; layer 1: even walks, no split at any step
    walks = torch.tensor([[[[10, 10, 10, 400]], [[10, 10, 400, 10]], [[10, 10, 400, 10]]],
                          [[[20, 20, 20, 20]]] * 3])
    summary = pair_split_persistence(walks, batch=1, max_steps=512, head_dim=64, sms=132)
    assert summary["pair_plan_steps"] == 4 and summary["pair_split_steps"] == 2
    # step 1 splits pair 2 where step 0 split pair 3 (missed, and it holds the longest walk); step 2 as step 1
    assert summary["pair_split_recall"] == 0.5 and summary["pair_split_same"] == 0.5
    assert summary["pair_split_longest_kept_single"] == 0.5
    # tiled to 2 rows of the one sequence: the same plans, twice the pairs
    assert pair_split_persistence(walks, batch=2, max_steps=512, head_dim=64, sms=132)["pair_split_recall"] == 0.5
    with pytest.raises(ValueError, match=r"\[layers, steps >= 2, B, Hkv\]"):
        pair_split_persistence(walks[:, :1], batch=1, max_steps=512, head_dim=64, sms=132)


def test_main_reads_the_walks_of_an_earlier_run(tmp_path):
    walks = [[[[10, 10, 10, 400]], [[10, 10, 400, 10]], [[10, 10, 400, 10]]]]
    source = tmp_path / "walks.json"
    source.write_text(json.dumps({"capture": "x", "context_tokens": 32760, "decode_steps": 8, "walks": walks}))
    out = tmp_path / "again.json"
    summary = main([str(source), "--from-json", "--pair-plan-batch", "1", "--out", str(out)])
    assert summary["pair_plan_max_steps"] == 512 and summary["pair_split_recall"] == 0.5
    written = json.loads(out.read_text())
    assert written["walks"] == walks and written["capture"] == "x" and written["summary"] == summary
    with pytest.raises(SystemExit):
        main([str(source), "--from-json", "--dtype", "bfloat16"])


@pytest.mark.parametrize("content, argv, message", [
    (None, [], "walks JSON {source} is not a file"),
    ("{", [], "is not valid JSON"),
    ('{"walks": [[[[5]]]]}', [], r"walks must be \[L, T, B, Hkv\] block counts of at least 2 decode steps"),
    ('{"walks": "abc"}', [], r"walks must be \[L, T, B, Hkv\] block counts"),
    ('{"walks": [[[[5]], [[6]]]]}', ["--pair-plan-batch", "1"], "lacks context_tokens, decode_steps"),
    ('{"walks": [[[[5]], [[6]]]]}', ["--pair-plan-batch", "1", "--sms", "0"], "--sms must be >= 1, got 0"),
    ('{"walks": [[[[5]], [[6]]]]}', ["--out", "{tmp}"], "is a folder; give a file name"),
])
def test_main_names_what_is_wrong_before_any_work(content, argv, message, tmp_path, capsys):
    source = tmp_path / "walks.json"
    if content is not None:
        source.write_text(content)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main([str(source), "--from-json", *argv])
    assert exit_.value.code == 2
    assert re.search(message.replace("{source}", re.escape(str(source))), capsys.readouterr().err)
