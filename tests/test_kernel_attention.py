"""`art_analysis.kernel_attention`: the SmolLM2 model decoding through the ART Triton kernel (CPU interpreter)."""
import contextlib

import pytest
import torch

from art_analysis.analysis import retention
from art_analysis.analysis.retention import RuleAttention, decode_rows, prefill
from art_analysis.corpus import passkey_prompt
from art_analysis.kernel_attention import KERNEL_ATTENTION_TAG, KernelAttention, kernel_attention
from art_analysis.termination import ARTConfig, FixedBudget, stop

RULE = ARTConfig(tau=1e-2, phi=1e-3, patience=2)   # can stop within the prompt's 10 blocks


@pytest.fixture(scope="module")
def prompt(loaded):
    return passkey_prompt(640, depth=0.5, seed=2, tokenizer=loaded.tokenizer)


def test_the_kernel_inside_the_model_stops_where_the_simulator_does(loaded, prompt, monkeypatch):
    """Each decode call of each layer loads the blocks that the simulator's walk under the same rule visits, and
    greedy decoding picks the same tokens, with next-token log-probabilities within float32 rounding."""
    model, steps = loaded.model, 3
    layers = model.config.num_hidden_layers
    cache, first = prefill(model, prompt.input_ids)
    kernel = KernelAttention(RULE)
    kernel_tokens, kernel_logprobs = decode_rows(model, cache, [first], steps, kernel)
    cache, _ = prefill(model, prompt.input_ids)
    simulator_blocks = []   # per call: the simulator's visited blocks over the cache's blocks, mean over heads

    def recorded_stop(trace, rule):
        result = stop(trace, rule)
        simulator_blocks.append(float((result.stop_step + 1).double().mean()) / trace.block_ids.shape[-1])
        return result

    monkeypatch.setattr(retention, "stop", recorded_stop)
    simulator_tokens, simulator_logprobs = decode_rows(model, cache, [first], steps, RuleAttention([RULE]))
    assert kernel_tokens.tolist() == simulator_tokens.tolist()
    assert sorted(kernel.loaded) == list(range(layers)) and all(len(v) == steps for v in kernel.loaded.values())
    in_call_order = [kernel.loaded[layer][step] for step in range(steps) for layer in range(layers)]
    assert in_call_order == pytest.approx(simulator_blocks, abs=1e-12)
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
    with pytest.raises(ValueError, match="without padding"):
        hook(None, None, query, key, value, padded)
    with pytest.raises(ValueError, match="without padding"):
        hook(None, None, query, key, value, padded == 0)
    with pytest.raises(ValueError, match="sliding window"):
        hook(None, None, query, key, value, None, sliding_window=64)
    # prefill calls go to the model's own attention
    called = []
    hook(lambda *args, **kwargs: called.append(args[1].shape), None, torch.zeros(1, 4, 5, 64), key, value, None)
    assert called == [(1, 4, 5, 64)]


@pytest.mark.gpu
def test_on_the_gpu_the_kernel_decodes_a_bf16_model_like_its_own_attention():
    """A randomly initialised Llama with SmolLM2's attention shapes (9 / 3 heads, D = 64), bf16 on the GPU, B = 4
    rows of 8k tokens: decoding through the dense kernel picks the model's own tokens, and ART with its walk hints
    (recorded on the device without a sync) decodes every step of every layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=16384,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 512, (4, 8192), device="cuda")
    mask = torch.ones_like(ids)
    generated = {}
    for name, attention in (("model", contextlib.nullcontext()), ("dense", kernel_attention(model)),
                            ("art", kernel_attention(model, ARTConfig()))):
        with attention as hook, torch.inference_mode():
            generated[name] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                             pad_token_id=0)[:, ids.shape[1]:]
    assert torch.equal(generated["dense"], generated["model"])
    assert sorted(hook.loaded) == [0, 1] and all(len(shares) == 4 for shares in hook.loaded.values())
    assert all(0 < share <= 1 for shares in hook.loaded.values() for share in shares)
    torch.cuda.synchronize()
    assert hook.hints[0].pair_walks.walks.shape == (4, 3)
