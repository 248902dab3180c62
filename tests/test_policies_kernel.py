"""A policy's selection through the paged ART kernel agrees with the simulator (output and stop steps)."""
import pytest
import torch

from art_analysis import policies
from art_analysis.policies.compose import paged_art_decode, paged_selection, simulate_policy
from art_analysis.synthetic import synthetic_cache
from art_analysis.termination import ARTConfig, stop

CONFIG = ARTConfig(tau=3e-3, phi=3e-4, patience=3)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def check_agreement(spec, dtype, order, *, batch, seqlen, head_dim, block, seqlens, device):
    cache = synthetic_cache(batch, 4, 2, seqlen, head_dim, preset="realistic", seed=1, dtype=dtype, device=device)
    seqlens = torch.tensor(seqlens, device=device)
    result = simulate_policy(policies.parse_spec(spec), cache.q, cache.k, cache.v, block_size=block, order=order,
                             cache_seqlens=seqlens, mode="kernel")
    expected = stop(result.trace, CONFIG)
    paged = paged_selection(cache.q, cache.k, cache.v, result.selection, block_size=block, cache_seqlens=seqlens)
    run = paged_art_decode(paged, art=CONFIG.kernel_params(), order=order, num_splits=1)
    assert torch.equal(run.steps[..., 0].long(), expected.stop_step[:, ::2] + 1)
    scale = expected.output.abs().amax()
    assert (run.out.double() - expected.output).abs().amax() <= TOLERANCE[dtype] * scale
    return expected, result


@pytest.mark.parametrize("order", ["sink_recency", "sequential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["streaming:budget=0.6", "quest:budget=0.5"])
def test_kernel_and_simulator_agree_on_a_policy_selection(spec, dtype, order):
    expected, result = check_agreement(spec, dtype, order, batch=2, seqlen=400, head_dim=64, block=16,
                                       seqlens=[400, 263], device="cpu")
    # The selection really drops blocks, and ART stops some walks before their end.
    assert (result.trace.steps_per_head < torch.tensor([[25], [17]])).all()
    assert (expected.stop_step + 1 < result.trace.steps_per_head).any()


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["streaming:budget=0.25", "snapkv:budget=0.3,window=64", "quest:budget=2048"])
def test_kernel_and_simulator_agree_at_real_size(spec):
    check_agreement(spec, torch.float16, "sink_recency", batch=4, seqlen=16384, head_dim=128, block=64,
                    seqlens=[16384, 9001, 12345, 4097], device="cuda")
