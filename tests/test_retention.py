import dataclasses

import pytest
import torch

from art_analysis.analysis.retention import RuleAttention, compare_generation, decode_rows, prefill
from art_analysis.blockwise import blockwise_attention
from art_analysis.cli import main
from art_analysis.corpus import niah_prompt, passkey_prompt
from art_analysis.policies.quest import block_score_bounds, group_block_bounds
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, FixedBudget, stop


@pytest.fixture(scope="module")
def prompt(loaded):
    return passkey_prompt(320, depth=0.5, seed=1, tokenizer=loaded.tokenizer)


def test_full_walk_in_the_decode_loop_reproduces_plain_greedy_decoding(loaded, prompt):
    model = loaded.model
    ids = torch.tensor([prompt.input_ids])
    with torch.inference_mode():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    cache, first = prefill(model, prompt.input_ids)
    hook = RuleAttention([None])
    tokens, logprobs = decode_rows(model, cache, [first], 5, hook)
    assert tokens[0].tolist() == plain
    assert logprobs.shape == (1, 5, model.config.vocab_size)
    assert hook.loaded == [[1.0] * (5 * model.config.num_hidden_layers)]
    assert model.config._attn_implementation == "sdpa"   # restored after the override


def test_rules_in_the_decode_loop(loaded, prompt):
    rules = {"never": ARTConfig(tau=0.0, phi=0.0), "one_block": FixedBudget(1)}
    table = compare_generation(loaded.model, loaded.tokenizer, [prompt], rules, max_new_tokens=4, progress=False)
    rows = {r["rule"].split(":")[0]: r for r in table.to_dict("records")}
    assert set(table["task"]) == {"passkey"}
    assert rows["dense"]["token_agreement"] == 1.0 and rows["dense"]["loaded_fraction"] == 1.0
    assert rows["dense"]["kl_max"] == 0.0
    # A rule that never stops walks everything and decodes exactly like dense.
    assert rows["never"]["token_agreement"] == 1.0 and rows["never"]["loaded_fraction"] == 1.0
    assert rows["never"]["kl_max"] < 1e-8
    # One block of five (320 prompt tokens plus the decoded ones, 64-token blocks) per call.
    assert 0.15 < rows["one_block"]["loaded_fraction"] < 0.25
    assert rows["one_block"]["first_divergence"] <= 4
    assert rows["one_block"]["kl_mean"] > 1e-3
    # The needle sits past the first block: one block never reads it, full walks always do.
    assert prompt.needle_start >= 64
    assert rows["one_block"]["needle_read"] == 0.0
    assert rows["dense"]["needle_read"] == 1.0 and rows["never"]["needle_read"] == 1.0


def test_rows_decode_independently_and_teacher_forcing_feeds_the_given_tokens(loaded, prompt):
    """Row r of a batch equals decoding rule r alone; a forced row sees the forced prefix."""
    model = loaded.model
    cache, first = prefill(model, prompt.input_ids)
    cache.batch_repeat_interleave(2)
    tokens, logprobs = decode_rows(model, cache, [first, first], 3, RuleAttention([None, FixedBudget(1)]))
    alone, alone_logprobs = decode_rows(model, prefill(model, prompt.input_ids)[0], [first], 3,
                                        RuleAttention([FixedBudget(1)]))
    assert torch.equal(tokens[1], alone[0])
    torch.testing.assert_close(logprobs[1], alone_logprobs[0], rtol=1e-4, atol=1e-4)
    assert not torch.equal(tokens[0], tokens[1]), "one block of five should change the greedy tokens"
    forced_tokens, forced = decode_rows(model, prefill(model, prompt.input_ids)[0], [first], 3,
                                        RuleAttention([FixedBudget(1)]), forced=tokens[0].tolist())
    # Step by step on the dense tokens: the same numbers.
    replay = []
    cache = prefill(model, prompt.input_ids)[0]
    for fed in tokens[0, :3].tolist():
        replay.append(decode_rows(model, cache, [fed], 1, RuleAttention([FixedBudget(1)]))[1][0, 0])
    torch.testing.assert_close(forced[0], torch.stack(replay))
    assert forced_tokens[0, 0] == first


def test_tasks_are_reported_separately(loaded, prompt):
    niah = niah_prompt(320, depth=0.5, seed=2, tokenizer=loaded.tokenizer)
    table = compare_generation(loaded.model, loaded.tokenizer, [prompt, niah], {"one_block": FixedBudget(1)},
                               max_new_tokens=2, progress=False)
    assert list(table["task"]) == ["passkey", "passkey", "niah", "niah"]
    assert (table["prompts"] == 1).all()


def test_importance_order_walks_blocks_by_their_key_bound():
    cache = synthetic_cache(1, 6, 2, 400, 16, preset="realistic", seed=5)
    query = cache.q[:, :, None]                                  # [B, Hq, 1, D], as the model passes it
    hook = RuleAttention([FixedBudget(2)], block_size=64, order="importance")
    out, _ = hook(None, None, query, cache.k, cache.v, None, scaling=0.25)
    bounds = block_score_bounds(cache.q, cache.k, cache.v, block_size=64).view(1, 2, 3, -1).amax(2)
    assert torch.equal(bounds, group_block_bounds(cache.q, cache.k, cache.v, block_size=64))
    trace = blockwise_attention(cache.q, cache.k, cache.v, block_size=64, order="importance",
                                block_scores=bounds, sm_scale=0.25)
    expected = stop(trace, FixedBudget(2)).output
    assert out.shape == (1, 1, 6, 16)
    torch.testing.assert_close(out[:, 0], expected.float())
    top_two = bounds.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(trace.block_ids[..., :2].sort(-1).values, top_two)
    assert hook.loaded == [[pytest.approx(128 / 400)]]


def test_importance_order_in_the_decode_loop_keeps_the_full_output(loaded, prompt):
    rows = compare_generation(loaded.model, loaded.tokenizer, [prompt], {"never": ARTConfig(tau=0.0, phi=0.0)},
                              max_new_tokens=3, order="importance").to_dict("records")
    assert [r["order"] for r in rows] == ["importance", "importance"]
    assert rows[1]["token_agreement"] == 1.0 and rows[1]["loaded_fraction"] == 1.0


def test_bad_arguments(loaded, prompt):
    with pytest.raises(ValueError, match="max_new_tokens"):
        compare_generation(loaded.model, loaded.tokenizer, [prompt], {}, max_new_tokens=1)
    with pytest.raises(ValueError, match="input_ids"):
        compare_generation(loaded.model, loaded.tokenizer, [passkey_prompt(2000, seed=0)], {})
    assert main(["evaluate", "--context", "10"]) == 2
    # 8188 prompt tokens and 6 new ones (5 decode steps after the prefill's) take 8193 positions, one past SmolLM2's
    assert loaded.model.config.max_position_embeddings == 8192
    long = dataclasses.replace(prompt, input_ids=(0,) * 8188)
    with pytest.raises(ValueError, match="8193 positions, past the model's maximum"):
        compare_generation(loaded.model, loaded.tokenizer, [long], {}, max_new_tokens=6)


def test_evaluate_checks_its_rule_and_seed_before_loading_the_model(monkeypatch, capsys):
    from art_analysis import models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(models, "load_model", no_model)
    for argv, message in ((["--seed", "-5"], "--seed must be >= 0, got -5"),
                          (["--tau", "-1"], "tau must be a finite number >= 0, got -1")):
        assert main(["evaluate", *argv]) == 2
        assert message in capsys.readouterr().err


def test_evaluate_command_prints_the_table(loaded, monkeypatch, capsys, tmp_path):
    from art_analysis import models

    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    out = tmp_path / "rows.json"
    assert main(["evaluate", "--context", "200", "--depths", "0.5", "--max-new-tokens", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "coverage_0.9: MassCoverage(gamma=0.9, head)" in printed
    assert out.exists()


def test_needle_read_is_the_share_of_heads_whose_walk_reached_the_needle_block():
    cache = synthetic_cache(2, 6, 2, 400, 16, preset="realistic", seed=6)
    query = cache.q[:, :, None]
    for needle, expected in (((70, 80), [0.0, 1.0]), ((10, 20), [1.0, 1.0]), ((60, 70), [1.0, 1.0])):
        hook = RuleAttention([FixedBudget(1), None], order="sequential", needle=needle)
        hook(None, None, query, cache.k, cache.v, None, scaling=0.25)
        assert [r[0] for r in hook.needle_read] == expected, needle
    with pytest.raises(ValueError, match="needle"):
        RuleAttention([None], needle=(5, 5))
