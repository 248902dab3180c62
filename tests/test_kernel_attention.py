"""`art_analysis.kernel_attention`: the SmolLM2 model decoding through the ART Triton kernel (CPU interpreter)."""
import contextlib

import pytest
import torch

from art_analysis.analysis import retention
from art_analysis.analysis.retention import RuleAttention, decode_rows, prefill
from art_analysis.blockwise import blockwise_attention
from art_analysis.corpus import passkey_prompt
from art_analysis.kernel_attention import (KERNEL_ATTENTION_TAG, KernelAttention, kernel_attention, loaded_tokens,
                                           visible_lengths)
from art_analysis.orders import walks_reading
from art_analysis.termination import ARTConfig, FixedBudget, kernel_walk_steps, stop
import kernels.art_decode as art_decode_module
from kernels.art_decode import art_decode
from kernels.split_plan import planned_result_steps
from kernels.art_decode import plan_decode

RULE = ARTConfig(tau=1e-2, phi=1e-3, patience=2)   # can stop within the prompt's 10 blocks


@pytest.fixture(scope="module")
def prompt(loaded):
    return passkey_prompt(640, depth=0.5, seed=2, tokenizer=loaded.tokenizer)


def test_the_kernel_inside_the_model_stops_where_the_simulator_does(loaded, prompt, monkeypatch):
    """Each decode call of each layer loads the tokens that the simulator's walk under the same rule visits, and
    greedy decoding picks the same tokens, with next-token log-probabilities within float32 rounding."""
    model, steps = loaded.model, 3
    layers = model.config.num_hidden_layers
    cache, first = prefill(model, prompt.input_ids)
    kernel = KernelAttention(RULE)
    kernel_tokens, kernel_logprobs = decode_rows(model, cache, [first], steps, kernel)
    cache, _ = prefill(model, prompt.input_ids)
    simulator_shares = []   # per call: the simulator's visited tokens over the cache's tokens, mean over heads

    def recorded_stop(trace, rule):
        result = stop(trace, rule)
        simulator_shares.append(float(result.loaded_fraction.double().mean()))
        return result

    monkeypatch.setattr(retention, "stop", recorded_stop)
    simulator_tokens, simulator_logprobs = decode_rows(model, cache, [first], steps, RuleAttention([RULE]))
    assert kernel_tokens.tolist() == simulator_tokens.tolist()
    assert sorted(kernel.loaded) == list(range(layers)) and all(len(v) == steps for v in kernel.loaded.values())
    in_call_order = [kernel.loaded[layer][step] for step in range(steps) for layer in range(layers)]
    assert in_call_order == pytest.approx(simulator_shares, abs=1e-12)
    assert min(in_call_order) < 0.5 and max(in_call_order) == 1.0   # some walks stop early, some read everything
    assert (kernel_logprobs - simulator_logprobs).abs().max() < 1e-3
    # every layer's hint holds its latest call's walks, one per KV head
    assert sorted(kernel.hints) == list(range(layers))
    assert kernel.hints[0].pair_walks.walks.shape == (1, model.config.num_key_value_heads)
    shares = kernel.loaded_fraction()
    assert shares[0] == pytest.approx(sum(kernel.loaded[0]) / steps)


def test_generate_through_the_dense_kernel_gives_the_models_greedy_tokens(loaded, prompt):
    model, ids = loaded.model, torch.tensor([prompt.input_ids])
    generated, hooks = {}, {}
    for name, attention in (("model", contextlib.nullcontext()), ("kernel", kernel_attention(model))):
        with attention as hooks[name], torch.inference_mode():
            generated[name] = model.generate(ids, max_new_tokens=3, do_sample=False)[0, ids.shape[1]:].tolist()
            assert model.config._attn_implementation.startswith(KERNEL_ATTENTION_TAG) == (name == "kernel")
    assert model.config._attn_implementation == "sdpa"   # restored
    assert generated["kernel"] == generated["model"]
    # two decode calls per layer (the first token comes from the prefill), every block read, no hints kept
    assert all(v == [1.0, 1.0] for v in hooks["kernel"].loaded.values()) and hooks["kernel"].hints == {}


def test_loaded_tokens_count_the_newest_blocks_tokens_where_the_walk_read_it():
    blocks = torch.tensor([[3, 2, 1]])              # 150 tokens: blocks of 64, 64 and 22 tokens
    assert loaded_tokens(blocks, 150, 64, "sink_recency").tolist() == [[150, 86, 64]]   # sink, then the newest
    assert loaded_tokens(blocks, 150, 64, "sequential").tolist() == [[150, 128, 64]]
    assert loaded_tokens(torch.tensor([1, 2]), 128, 64, "sink_recency").tolist() == [64, 128]


def test_loaded_tokens_take_each_pairs_own_length():
    blocks = torch.tensor([[3, 2], [1, 2]])                             # lengths 150 and 100 (blocks of 64)
    lengths = torch.tensor([[150], [100]])
    assert loaded_tokens(blocks, lengths, 64, "sink_recency").tolist() == [[150, 86], [64, 100]]


def test_visible_lengths_read_a_static_caches_filled_slots():
    """A static cache's decode mask hides each row's slots past its tokens: the rows' lengths; a mask that shows
    every key gives None (the uniform path); left padding and a row with nothing visible are refused."""
    keys = 10
    slots = torch.arange(keys)
    static = (slots[None, :] < torch.tensor([[7], [10], [3]]))[:, None, None, :]     # [3, 1, 1, 10], True visible
    assert visible_lengths(static, 3, keys).tolist() == [7, 10, 3]
    additive = torch.zeros(3, 1, 1, keys).masked_fill(~static, torch.finfo(torch.float32).min)
    assert visible_lengths(additive, 3, keys).tolist() == [7, 10, 3]
    assert visible_lengths(static[:1], 2, keys).tolist() == [7, 7]                # one mask for the whole batch
    assert visible_lengths(torch.ones(2, 1, 1, keys, dtype=torch.bool), 2, keys) is None
    assert visible_lengths(None, 2, keys) is None
    with pytest.raises(ValueError, match="without left padding"):
        visible_lengths(slots[None, None, None, :] >= 2, 1, keys)
    with pytest.raises(ValueError, match="hides every cached key"):
        visible_lengths(torch.zeros(1, 1, 1, keys, dtype=torch.bool), 1, keys)


def test_a_static_cache_decodes_through_the_kernel_like_a_dynamic_one(loaded, prompt):
    """generate(cache_implementation="static") hands the kernel the whole static buffer with the unfilled slots
    masked: it reads each row's filled slots only, so greedy decoding picks the model's own tokens densely, and
    under ART the tokens and every call's loaded share of a dynamic cache's run."""
    model, ids = loaded.model, torch.tensor([prompt.input_ids])
    runs = {}
    for name, art, cache in (("model", None, "static"), ("dense", None, "static"), ("art static", RULE, "static"),
                             ("art dynamic", RULE, "dynamic")):
        attention = contextlib.nullcontext() if name == "model" else kernel_attention(model, art)
        options = {"cache_implementation": "static"} if cache == "static" else {}
        with attention as hook, torch.inference_mode():
            tokens = model.generate(ids, max_new_tokens=3, do_sample=False, **options)[0, ids.shape[1]:].tolist()
        runs[name] = (tokens, None if hook is None else hook.loaded)
    assert runs["dense"][0] == runs["model"][0]
    assert all(v == [1.0, 1.0] for v in runs["dense"][1].values())
    assert runs["art static"][0] == runs["art dynamic"][0]
    static, dynamic = runs["art static"][1], runs["art dynamic"][1]
    assert sorted(static) == sorted(dynamic)
    for layer in static:
        assert static[layer] == pytest.approx(dynamic[layer], abs=1e-12)
    assert min(share for shares in static.values() for share in shares) < 0.5      # walks that stop early


@pytest.mark.parametrize("order", ["sink_recency", "importance"])
def test_a_static_cache_decodes_through_the_simulator_hook_like_a_dynamic_one(loaded, prompt, order):
    """The simulator's hook reads the static buffer's decode mask as each row's length, as the kernel's does: dense,
    the model's own log-probabilities; under ART, a dynamic cache's tokens and loaded shares."""
    from art_analysis.analysis.retention import RuleAttention
    from art_analysis.attention_override import override_attention

    model, ids = loaded.model, torch.tensor([prompt.input_ids])
    runs = {}
    for name, rule, cache in (("model", None, "static"), ("dense", None, "static"), ("art static", RULE, "static"),
                              ("art dynamic", RULE, "dynamic")):
        hook = None if name == "model" else RuleAttention([rule], order=order)
        attention = contextlib.nullcontext() if hook is None else override_attention(model, hook, "art_rule")
        options = {"cache_implementation": "static"} if cache == "static" else {}
        with attention, torch.inference_mode():
            out = model.generate(ids, max_new_tokens=3, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, **options)
        runs[name] = (torch.stack(out.scores).log_softmax(-1), None if hook is None else hook.loaded[0])
    torch.testing.assert_close(runs["dense"][0], runs["model"][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(runs["art static"][0], runs["art dynamic"][0], atol=1e-5, rtol=0)
    assert runs["art static"][1] == pytest.approx(runs["art dynamic"][1], abs=1e-12)
    assert min(runs["art static"][1]) < 0.5


def test_the_needle_share_counts_the_blocks_that_entered_the_output(loaded, prompt, monkeypatch):
    """Decoding through the kernel told the prompt's needle, each call records the share of query heads whose
    output took in a needle block: on the call's own inputs, the simulator's walks under the rule with one split,
    and over 2 splits (followers at once) the walks the kernel's output holds, the simulator's where the leader
    stops within its range, else the whole cache (though the followers of a leader that stopped loaded blocks past
    its stop step).  A dense call's output takes in every block."""
    model, steps = loaded.model, 1
    layers = model.config.num_hidden_layers
    needle = (prompt.needle_start, prompt.needle_end)
    for splits in (1, 2):
        expected, cut = [], 0     # per call, the share of walks whose output holds a needle block

        def checked(q, k, v, *, sm_scale, num_splits, **kwargs):
            nonlocal cut
            assert num_splits is None
            trace = blockwise_attention(q, k, v, block_size=64, order="sink_recency", sm_scale=sm_scale)
            walks = kernel_walk_steps(stop(trace, RULE), k.shape[1])                           # [1, Hkv]
            blocks = trace.block_ids.shape[-1]
            taken = planned_result_steps(walks, blocks, splits)
            cut += int((taken != walks).any())
            expected.append(float(walks_reading(trace.block_ids, taken, needle, 64).double().mean()))
            return art_decode(q, k, v, sm_scale=sm_scale, num_splits=splits, follow_step=0, **kwargs)

        monkeypatch.setattr(art_decode_module, "art_decode", checked)
        kernel = KernelAttention(RULE, needle=needle)
        cache, first = prefill(model, prompt.input_ids)
        decode_rows(model, cache, [first], steps, kernel)
        got = [kernel.needle_read[layer][step] for step in range(steps) for layer in range(layers)]
        assert got == pytest.approx(expected, abs=1e-12), splits
        assert min(got) < max(got), "the calls must cover walks that read the needle and walks that stop before it"
        assert (cut > 0) == (splits == 2), "over 2 splits some leaders must walk past their range"
    monkeypatch.undo()
    # the hook used again after reset() records the new run's calls alone, with hints made afresh
    stale_hint = kernel.hints[0]
    kernel.reset()
    assert kernel.loaded == {} and kernel.needle_read == {} and kernel.hints == {} and kernel.loaded_fraction() == {}
    cache, first = prefill(model, prompt.input_ids)
    decode_rows(model, cache, [first], steps, kernel)
    assert all(len(kernel.needle_read[layer]) == len(kernel.loaded[layer]) == steps for layer in range(layers))
    assert sorted(kernel.hints) == list(range(layers)) and kernel.hints[0] is not stale_hint
    dense = KernelAttention(None, needle=needle)
    cache, first = prefill(model, prompt.input_ids)
    decode_rows(model, cache, [first], steps, dense)
    assert all(shares == [1.0] * steps for shares in dense.needle_read.values())
    with pytest.raises(ValueError, match="needle must be a token range"):
        KernelAttention(RULE, needle=(5, 5))


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="ARTConfig, a kernels.art_params.ARTParams or None, got FixedBudget"):
        KernelAttention(FixedBudget(2))
    with pytest.raises(ValueError, match="group='all'"):
        KernelAttention(ARTConfig(group="head"))
    hook = KernelAttention(RULE)
    query = torch.zeros(1, 4, 1, 64)
    key = value = torch.zeros(1, 2, 100, 64)
    padded = torch.zeros(1, 1, 1, 100)
    padded[..., :3] = float("-inf")
    with pytest.raises(ValueError, match="without left padding"):
        hook(None, None, query, key, value, padded)
    with pytest.raises(ValueError, match="without left padding"):
        hook(None, None, query, key, value, padded == 0)
    with pytest.raises(ValueError, match="sliding window"):
        hook(None, None, query, key, value, None, sliding_window=64)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B or 1, 1, 1, >= 100 keys\] for B = 1, got "
                                         r"shape \(1, 1, 1, 60\)"):
        hook(None, None, query, key, value, padded[..., :60])
    with pytest.raises(ValueError, match=r"order must be one of \('sequential', 'sink_recency'\) \(the kernel's\)"):
        KernelAttention(RULE, order="recency")
    with pytest.raises(TypeError, match="single_walk must be True or False, got 'yes'"):
        KernelAttention(RULE, single_walk="yes")
    with pytest.raises(TypeError, match="walk_hints must be True or False, got 1"):
        KernelAttention(RULE, walk_hints=1)
    # the simulator's hook refuses the same
    from art_analysis.analysis.retention import RuleAttention

    with pytest.raises(ValueError, match="order must be one of"):
        RuleAttention([RULE], order="bogus")
    with pytest.raises(ValueError, match="RuleAttention needs a batch without left padding"):
        RuleAttention([RULE])(None, None, query, key, value, padded)
    with pytest.raises(ValueError, match="RuleAttention runs full causal attention"):
        RuleAttention([RULE])(None, None, query, key, value, None, softcap=30.0)
    # prefill calls go to the model's own attention
    called = []
    hook(lambda *args, **kwargs: called.append(args[1].shape), None, torch.zeros(1, 4, 5, 64), key, value, None)
    assert called == [(1, 4, 5, 64)]


def test_single_walks_take_one_split_and_no_hint_and_load_what_the_simulators_walk_visits(monkeypatch):
    """The production hook plans each call with a walk hint; the single-walk hook forces one split and no hint, so
    its loaded share is the simulator's walk under the rule on a cache long enough for the plan to split."""
    from types import SimpleNamespace

    from kernels.walk_hint import LongestWalkHint

    from art_analysis.synthetic import synthetic_cache

    cache = synthetic_cache(batch=1, num_q_heads=4, num_kv_heads=2, seqlen=2048, head_dim=64, preset="realistic",
                            seed=0, dtype=torch.float16)
    q, k, v = cache.q[:, :, None], cache.k, cache.v                          # q [1, 4, 1, 64], k, v [1, 2, 2048, 64]
    trace = blockwise_attention(q[:, :, 0], k, v, block_size=64, order="sink_recency", mode="kernel")
    walks = kernel_walk_steps(stop(trace, RULE), k.shape[1])                                             # [1, Hkv]
    expected = float(loaded_tokens(walks, k.shape[2], 64, "sink_recency").sum()) / (k.shape[1] * k.shape[2])
    assert expected < 1, "the rule must stop within the cache"
    seen = []

    def recorded(*args, num_splits=None, walk_hint=None, **kwargs):
        seen.append((num_splits, walk_hint))
        return art_decode(*args, num_splits=num_splits, walk_hint=walk_hint, **kwargs)

    monkeypatch.setattr(art_decode_module, "art_decode", recorded)
    layer = SimpleNamespace(layer_idx=0)
    production, single = KernelAttention(RULE), KernelAttention(RULE, single_walk=True)
    for hook in (production, single):
        hook(None, layer, q, k, v, None)
    assert seen[0][0] is None and isinstance(seen[0][1], LongestWalkHint) and production.hints == {0: seen[0][1]}
    assert seen[1] == (1, None) and single.hints == {}
    assert plan_decode(q[:, :, 0], k, v, art=RULE.kernel_params()).num_splits > 1, "the production plan splits"
    assert single.loaded == {0: [pytest.approx(expected, abs=1e-12)]}


def test_retention_on_the_kernel_backend_agrees_with_the_simulator(loaded, prompt):
    """compare_generation(backend="kernel") decodes the ART rule through the kernel and the coverage rule in the
    simulator: the kernel's row has the simulator backend's tokens, loaded fraction, needle share and, within
    float32 rounding, KL (on this short prompt every call's plan keeps its stop); the other rows are the simulator
    backend's."""
    from art_analysis.analysis.retention import compare_generation
    from art_analysis.termination import MassCoverage

    rules = {"art": RULE, "coverage": MassCoverage(0.9)}
    tables = {backend: compare_generation(loaded.model, loaded.tokenizer, [prompt], rules, max_new_tokens=3,
                                          progress=False, backend=backend).set_index("rule")
              for backend in ("simulator", "kernel", "kernel_single_walk")}
    simulator, kernel = tables["simulator"], tables["kernel"]
    art = f"art: {RULE.name}"
    assert list(kernel.index) == ["dense", f"{art} (kernel)", "coverage: " + MassCoverage(0.9).name]
    assert f"{art} (kernel, single walks)" in tables["kernel_single_walk"].index
    for on_kernel in (kernel.loc[f"{art} (kernel)"], tables["kernel_single_walk"].loc[f"{art} (kernel, single walks)"]):
        in_simulator = simulator.loc[art]
        assert on_kernel["token_agreement"] == in_simulator["token_agreement"]
        assert on_kernel["accuracy"] == in_simulator["accuracy"]
        assert on_kernel["loaded_fraction"] == pytest.approx(in_simulator["loaded_fraction"], abs=1e-12)
        assert on_kernel["loaded_fraction"] < 0.9
        assert on_kernel["kl_max"] == pytest.approx(in_simulator["kl_max"], abs=1e-4)
        assert on_kernel["needle_read"] == pytest.approx(in_simulator["needle_read"], abs=1e-12)
        assert 0 < on_kernel["needle_read"] < 1, "some walks stop before the needle's block, some read it"
    for rule in ("dense", "coverage: " + MassCoverage(0.9).name):   # a batch of two rows instead of three
        for column in ("token_agreement", "accuracy", "loaded_fraction", "needle_read", "first_divergence"):
            assert kernel.loc[rule, column] == pytest.approx(simulator.loc[rule, column], abs=1e-12)
        assert kernel.loc[rule, "kl_max"] == pytest.approx(simulator.loc[rule, "kl_max"], abs=1e-4)
    with pytest.raises(ValueError, match="64-token blocks"):
        compare_generation(loaded.model, loaded.tokenizer, [prompt], rules, order="importance", backend="kernel")
    with pytest.raises(ValueError, match="backend must be one of"):
        compare_generation(loaded.model, loaded.tokenizer, [prompt], rules, backend="triton")


def test_evaluate_refuses_the_kernel_backend_without_a_gpu_or_the_interpreter(monkeypatch, capsys):
    from art_analysis.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for backend in ("kernel", "kernel_single_walk"):
        assert main(["evaluate", "--backend", backend]) == 2
        assert f"--backend {backend} runs the Triton kernel" in capsys.readouterr().err


@pytest.mark.gpu
def test_on_the_gpu_the_kernel_decodes_a_bf16_model_like_its_own_attention():
    """A randomly initialised Llama with SmolLM2's attention shapes (9 / 3 heads, D = 64), bf16 on the GPU, B = 4
    rows of 8k tokens: decoding through the dense kernel picks the model's own tokens, with a dynamic or a static
    cache, and ART with its walk hints (recorded on the device without a sync) decodes every step of every layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=16384,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 512, (4, 8192), device="cuda")
    mask = torch.ones_like(ids)
    generated = {}
    static = {"cache_implementation": "static"}
    for name, attention, options in (("model", contextlib.nullcontext(), {}), ("dense", kernel_attention(model), {}),
                                     ("dense static", kernel_attention(model), static),
                                     ("art", kernel_attention(model, ARTConfig()), {})):
        with attention as hook, torch.inference_mode():
            generated[name] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                             pad_token_id=0, **options)[:, ids.shape[1]:]
    assert torch.equal(generated["dense"], generated["model"])
    assert torch.equal(generated["dense static"], generated["model"])   # the filled slots as cache_seqlens
    assert sorted(hook.loaded) == [0, 1] and all(len(shares) == 4 for shares in hook.loaded.values())
    assert all(0 < share <= 1 for shares in hook.loaded.values() for share in shares)
    torch.cuda.synchronize()
    assert hook.hints[0].pair_walks.walks.shape == (4, 3)


@pytest.mark.gpu
def test_on_the_gpu_retention_runs_on_the_kernel_backend_with_the_model_on_the_device():
    """compare_generation(backend="kernel") with a model on the GPU (a random bf16 Llama of SmolLM2's attention
    shapes, a 4096-token prompt): prefill and decoding feed the model's device, the ART rule decodes through the
    kernel (its row marked), and a rule that never stops decodes as dense does."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from art_analysis.analysis.retention import compare_generation
    from art_analysis.corpus import Prompt

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = tuple(torch.randint(0, 512, (4096,)).tolist())
    prompt = Prompt(kind="passkey", text="", answer="7", depth=0.5, seed=0, length=4096, unit="tokens",
                    needle_start=2000, needle_end=2010, haystack_start=0, haystack_end=4096, input_ids=ids)
    tokenizer = SimpleNamespace(decode=lambda tokens: " ".join(map(str, tokens)))
    rows = compare_generation(model, tokenizer, [prompt], {"never": ARTConfig(tau=0.0, phi=0.0)}, max_new_tokens=4,
                              progress=False, backend="kernel").set_index("rule")
    never = rows.loc[f"never: {ARTConfig(tau=0.0, phi=0.0).name} (kernel)"]
    assert never["loaded_fraction"] == 1.0 and never["kl_max"] < 1e-2   # bf16: the kernel's sums, not the simulator's
    assert rows.loc["dense", "loaded_fraction"] == 1.0 and rows.loc["dense", "kl_max"] == 0.0
