"""The Triton block-sparse prefill kernel and on-device estimation, held to the PyTorch reference.

CPU runs use the Triton interpreter with fp16 on small shapes; ``-m gpu`` runs bf16 at real
sizes.
"""
import pytest
import torch

from art_analysis.flexprefill import relative_error, representative_attention, select_blocks, sparse_attention
from kernels.bench_flexprefill import structured_prefill
import kernels.block_sparse as block_sparse_module
from kernels.block_sparse import (KernelConfig, block_sparse_attention, column_table, flexprefill_attention,
                                  heads_first)
from art_analysis.flexprefill import coverage_count, query_aware_mask
from kernels.flexprefill_estimate import (LINE_SUMS_CONFIG, estimate_block_mask, query_aware_blocks,
                                         pooled_lines, representative_lines, vertical_slash_blocks)


def _inputs(b, hq, hkv, n, d, dtype=torch.float16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, device=device).to(dtype) for h in (hq, hkv, hkv))


def _random_mask(b, h, nb, keep, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    mask = torch.rand(b, h, nb, nb, generator=gen, device=device) < keep
    idx = torch.arange(nb, device=device)
    return mask | (idx[None, :] == idx[:, None])


def test_column_table_lists_kept_blocks_ascending():
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 0, 0] = True
    mask[0, 0, 2, [0, 2]] = True
    mask[0, 0, 3, [1, 2, 3]] = True
    mask[0, 0, 1, 3] = True  # above the diagonal: dropped
    cols, counts = column_table(mask)
    assert counts.tolist() == [[[1, 0, 2, 3]]]
    assert cols[0, 0, 0, :1].tolist() == [0]
    assert cols[0, 0, 2, :2].tolist() == [0, 2]
    assert cols[0, 0, 3, :3].tolist() == [1, 2, 3]
    assert cols.dtype == torch.int32 and counts.dtype == torch.int32


@pytest.mark.parametrize("chunk", [16, None])
def test_column_table_matches_a_torch_scan_on_random_masks(chunk):
    mask = _random_mask(2, 3, 40, 0.3, seed=2)
    cols, counts = column_table(mask, chunk=chunk)
    causal = mask & torch.ones(40, 40, dtype=torch.bool).tril()
    assert torch.equal(counts, causal.sum(-1, dtype=torch.int32))
    for b, h, row in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(40)).tolist():
        expected = causal[b, h, row].nonzero().flatten().tolist()
        assert cols[b, h, row, :len(expected)].tolist() == expected


@pytest.mark.parametrize("hq,hkv,n,d,bs,config", [
    (4, 2, 200, 64, 32, None), (3, 1, 64, 128, 16, None),
    (4, 2, 200, 64, 64, KernelConfig(32, 16, 4, 1, heads_first=True))])
def test_kernel_matches_reference_fp16(hq, hkv, n, d, bs, config):
    q, k, v = _inputs(2, hq, hkv, n, d)
    nb = -(-n // bs)
    mask = _random_mask(2, hq, nb, 0.4)
    out, lse = block_sparse_attention(q, k, v, mask, block_size=bs, return_lse=True, config=config)
    ref, ref_lse = sparse_attention(q, k, v, mask, bs, return_lse=True, compute_dtype=torch.float64)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    fp16_torch = sparse_attention(q, k, v, mask, bs).half()
    err = (out.double() - ref).abs().max()
    assert err <= 3 * (fp16_torch.double() - ref).abs().max() + 1e-3
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)


def test_launch_order_is_side_by_side_only_on_small_grids(monkeypatch):
    monkeypatch.setattr(block_sparse_module, "num_sms", lambda device: 132)
    auto = KernelConfig(128, 64, 4, 2)
    slots = block_sparse_module.PROGRAMS_PER_SM * 132
    threshold = block_sparse_module.HEADS_FIRST_BELOW * slots
    cuda = torch.device("cuda")
    assert heads_first(auto, 9 * 256, cuda)                      # SmolLM2 at 32k: 8.7 tiles per slot
    assert not heads_first(auto, 9 * 1024, cuda)                 # SmolLM2 at 128k
    assert not heads_first(auto, 32 * 256, cuda)                 # 32 heads at 32k
    assert heads_first(auto, threshold - 1, cuda) and not heads_first(auto, threshold, cuda)
    assert not heads_first(KernelConfig(128, 64, 4, 2, heads_first=False), 1, cuda)
    assert heads_first(KernelConfig(128, 64, 4, 2, heads_first=True), 10 ** 9, cuda)


@pytest.mark.parametrize("order", [True, False])
def test_both_launch_orders_give_the_same_output(order):
    q, k, v = _inputs(1, 4, 2, 160, 64, seed=6)
    mask = _random_mask(1, 4, 5, 0.5, seed=6)
    auto = block_sparse_attention(q, k, v, mask, block_size=32)
    forced = block_sparse_attention(q, k, v, mask, block_size=32, config=KernelConfig(32, 32, 4, 1, heads_first=order))
    assert torch.equal(auto, forced)


def test_kernel_reads_strided_and_unaligned_views_like_contiguous_inputs():
    q, k, v = _inputs(2, 4, 2, 200, 64, seed=4)
    mask = _random_mask(2, 4, 7, 0.5, seed=4)
    expected = block_sparse_attention(q, k, v, mask, block_size=32)
    sequence_major = q.transpose(1, 2).contiguous().transpose(1, 2)       # [B, N, H, D] storage: descriptor-ready
    padded = torch.zeros(2, 2, 200, 72, dtype=k.dtype)[..., :64]           # 144-byte rows: copied first
    padded.copy_(k)
    out = block_sparse_attention(sequence_major, padded, v, mask, block_size=32)
    assert torch.equal(out, expected)


def test_kernel_empty_rows_give_zero_output_and_minus_inf_lse():
    q, k, v = _inputs(1, 2, 1, 96, 64)
    mask = torch.zeros(1, 2, 3, 3, dtype=torch.bool)
    mask[0, 0] = torch.eye(3, dtype=torch.bool)
    out, lse = block_sparse_attention(q, k, v, mask, block_size=32, return_lse=True)
    assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all()
    ref = sparse_attention(q, k, v, mask, 32)
    assert torch.allclose(out[0, 0].float(), ref[0, 0], atol=2e-3)


def test_all_tiles_equal_dense_causal_attention():
    q, k, v = _inputs(1, 4, 2, 100, 64, seed=3)
    mask = torch.ones(1, 4, 4, 4, dtype=torch.bool)
    out = block_sparse_attention(q, k, v, mask, block_size=32)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1), is_causal=True)
    assert (out.float() - dense).abs().max() < 2e-3


@pytest.mark.parametrize("n,bs,keys_per_program", [(150, 32, None), (300, 128, 128), (100, 128, None), (77, 16, 32)])
def test_estimation_lines_match_reference(n, bs, keys_per_program):
    q, k, _ = _inputs(2, 4, 2, n, 64, seed=1)
    lines = representative_lines(q, k, block_size=bs, sm_scale=0.125, keys_per_program=keys_per_program)
    stats = representative_attention(q, k, block_size=bs, sm_scale=0.125)
    assert torch.allclose(lines[:, :, 0], stats.vertical, atol=1e-6)
    assert torch.allclose(lines[:, :, 1], stats.slash, atol=1e-6)
    assert torch.allclose(lines.sum(-1), torch.ones(2, 4, 2), atol=1e-5)


@pytest.mark.parametrize("block_n,split", [(128, 1), (32, 2), (64, 1)])
def test_estimation_lines_match_reference_in_every_tiling(monkeypatch, block_n, split):
    monkeypatch.setitem(LINE_SUMS_CONFIG, "block_n", block_n)
    monkeypatch.setitem(LINE_SUMS_CONFIG, "split", split)
    q, k, _ = _inputs(1, 2, 1, 300, 64, seed=3)
    lines = representative_lines(q, k, block_size=128, sm_scale=0.125, keys_per_program=256)
    stats = representative_attention(q, k, block_size=128, sm_scale=0.125)
    assert torch.allclose(lines[:, :, 0], stats.vertical, atol=1e-6)
    assert torch.allclose(lines[:, :, 1], stats.slash, atol=1e-6)


@pytest.mark.parametrize("gamma", [0.25, 0.3, 0.375, 0.5, 0.6, 0.75, 0.8, 0.875, 0.9, 1.0])
def test_line_budgets_equal_the_sorted_prefix_with_ties(gamma):
    # exact binary fractions, so every prefix sum is exact: the crossing lands inside tie groups
    # (0.125 x 4, 0.0625 x 4) and on them (0.5, 0.875, 1.0), and below the total (1.0 = gamma)
    values = torch.tensor([0.0625, 0.125, 0.0, 0.25, 0.125, 0.0625, 0.125, 0.0625, 0.125, 0.0625, 0.0, 0.0])
    lines = torch.stack((values, values.flip(0))).view(1, 1, 2, -1)
    _, budgets = vertical_slash_blocks(lines, pooled_lines(lines, 4), gamma=gamma, lowest=0, highest=3, divisor=1)
    expected = coverage_count(lines, gamma).clamp(max=3)
    assert torch.equal(budgets, expected), (gamma, budgets, expected)


@pytest.mark.parametrize("gamma,lowest,highest", [(0.5, 1, 9), (0.8, 2, 9), (0.9, 0, 3), (1.0, 1, 9), (0.7, 20, 9)])
def test_query_aware_coverage_breaks_flat_ties_in_row_major_order(gamma, lowest, highest):
    # equal keys give uniform rows (every row a tie group); repeated keys give ties inside rows
    gen = torch.Generator().manual_seed(4)
    nb, d = 9, 16
    keys = torch.randn(1, 1, 3, d, generator=gen).repeat(1, 1, 3, 1)
    keys[:, :, 6:] = 0.0
    queries = torch.randn(1, 2, nb, d, generator=gen)
    queries[:, 1] = 0.0
    mask = query_aware_blocks(queries, keys, gamma=gamma, scale=0.5, lowest=lowest, highest=highest)
    reference = query_aware_mask(queries, keys, gamma=gamma, block_size=1, sm_scale=0.5, min_blocks=min(lowest, nb),
                                 max_blocks=highest)
    idx = torch.arange(nb)
    forced = ((idx[None, :] == 0) | (idx[None, :] == idx[:, None])) & (idx[None, :] <= idx[:, None])
    assert torch.equal(mask, reference | forced)


@pytest.mark.parametrize("batch,tau,max_budget,union", [(1, 0.0, None, False), (1, 0.15, None, False),
                                                        (1, 1.0, None, False), (1, 1.0, 160, False),
                                                        (1, 0.15, 96, True), (2, 1.0, None, False)])
def test_estimated_mask_equals_reference_selection(batch, tau, max_budget, union):
    # tau = 1: every head query-aware (at B = 2 the query-aware search takes every head of both sequences)
    q, k, _ = structured_prefill(batch, 8, 4, 512, 64, seed=2, dtype=torch.float16, device="cpu")
    params = dict(gamma=0.85, tau=tau, block_size=32, min_budget=64, max_budget=max_budget,
                  union_vs_for_query_aware=union)
    estimate = estimate_block_mask(q, k, **params)
    reference = select_blocks(q, k, **params)
    assert torch.equal(estimate.pattern, reference.pattern)
    assert torch.equal(estimate.block_mask, reference.block_mask)
    assert torch.equal(estimate.budgets[..., 0], reference.vertical_blocks)
    assert torch.allclose(estimate.js_distance, reference.js_distance, atol=1e-5)


@pytest.mark.parametrize("gamma,tau,min_budget,divisor,js_eps",
                         [(0.95, 0.15, 32, 16, None), (1.0, 1.0, 0, None, 1e-10)])
def test_estimated_mask_equals_reference_on_repeated_input_with_ties(gamma, tau, min_budget, divisor, js_eps):
    q, k, _ = structured_prefill(1, 4, 4, 128, 64, seed=5, dtype=torch.float16, device="cpu")
    q, k = q.repeat(1, 1, 3, 1), k.repeat(1, 1, 3, 1)  # equal block scores: ties broken by the lower index
    params = dict(gamma=gamma, tau=tau, block_size=16, min_budget=min_budget, max_budget=128, budget_divisor=divisor,
                  js_eps=js_eps)
    estimate = estimate_block_mask(q, k, **params)
    reference = select_blocks(q, k, **params)
    assert torch.equal(estimate.pattern, reference.pattern)
    assert torch.equal(estimate.block_mask, reference.block_mask)
    assert torch.equal(estimate.budgets, torch.stack((reference.vertical_blocks, reference.slash_blocks), -1))
    assert torch.allclose(estimate.js_distance, reference.js_distance, atol=1e-5, equal_nan=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_estimated_js_distance_is_nan_where_a_block_has_no_mass_without_epsilon_as_the_reference():
    # every query is u and the keys of block 1 are -30 u: scores of -240 there, whose exp is 0 in float32, so
    # both distributions hold a zero block; upstream's 0 * log(0 / 0) makes D_JS NaN, an epsilon keeps it finite
    q, k, _ = structured_prefill(1, 2, 2, 64, 64, seed=6, dtype=torch.float32, device="cpu")
    u = torch.where(torch.arange(64) % 3 == 0, -1.0, 1.0)
    q[:] = u
    k[:, :, 16:32] = -30 * u
    params = dict(gamma=0.9, tau=0.1, block_size=16, min_budget=16, max_budget=64)
    for js_eps in (None, 1e-10):
        estimate = estimate_block_mask(q, k, js_eps=js_eps, **params)
        reference = select_blocks(q, k, js_eps=js_eps, **params)
        assert torch.equal(torch.isnan(estimate.js_distance), torch.isnan(reference.js_distance))
        assert torch.isnan(estimate.js_distance).all() == (js_eps is None)
        assert torch.allclose(estimate.js_distance, reference.js_distance, atol=1e-5, equal_nan=True)
        assert torch.equal(estimate.pattern, reference.pattern)


def test_kernel_coverage_at_gamma_one_takes_no_zero_entries_as_the_reference():
    # 33 tokens of mass 1/33 and 31 of none: the float32 running sum stays under 1 at the last nonzero token
    line = torch.zeros(64)
    line[:33] = 1.0 / 33
    lines = torch.stack((line, line)).view(1, 1, 2, 64).contiguous()
    _, budgets = vertical_slash_blocks(lines, pooled_lines(lines, 1), gamma=1.0, lowest=0, highest=64, divisor=1)
    assert budgets.flatten().tolist() == coverage_count(lines, 1.0).flatten().tolist() == [33, 33]
    # query-aware rows that put all their mass on one block each (exp underflows elsewhere)
    keys = torch.randn(1, 1, 33, 16, generator=torch.Generator().manual_seed(0)) * 30
    queries = keys[:, :, :1].expand(1, 1, 33, 16).contiguous()
    kernel = query_aware_blocks(queries, keys, gamma=1.0, scale=1.0, lowest=0, highest=33)
    reference = query_aware_mask(queries, keys, gamma=1.0, block_size=1, sm_scale=1.0, min_blocks=0, max_blocks=33)
    assert torch.equal(kernel, reference | torch.eye(33, dtype=torch.bool))
    assert int(kernel.sum()) < 33 * 34 // 2


def test_kernel_budget_in_blocks_does_not_overflow_at_a_divisor_near_two_to_the_31():
    lines = torch.full((1, 1, 2, 64), 1.0 / 64)
    _, budgets = vertical_slash_blocks(lines, pooled_lines(lines, 1), gamma=0.5, lowest=0, highest=64,
                                       divisor=2 ** 31 - 1)
    assert budgets.flatten().tolist() == [1, 1]


def test_flexprefill_attention_chains_estimation_and_kernel():
    q, k, v = structured_prefill(1, 4, 2, 256, 64, seed=4, dtype=torch.float16, device="cpu")
    out, lse, estimate = flexprefill_attention(q, k, v, gamma=0.9, tau=0.1, block_size=32, min_budget=32,
                                               return_lse=True, return_estimate=True)
    selection = select_blocks(q, k, gamma=0.9, tau=0.1, block_size=32, min_budget=32)
    assert torch.equal(estimate.block_mask, selection.block_mask)
    ref, ref_lse = sparse_attention(q, k, v, selection.block_mask, 32, return_lse=True)
    assert relative_error(out, ref).max() < 2e-3
    assert torch.allclose(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("change,error,match", [
    (dict(k_len=96), ValueError, "same length"),
    (dict(d=96), ValueError, "head dim"),
    (dict(dtype=torch.float32), TypeError, "float16 or bfloat16"),
    (dict(causal=False), ValueError, "only causal"),
    (dict(block_size=48), ValueError, "block_size"),
    (dict(mask_blocks=3), ValueError, "block_mask must have shape"),
    (dict(block_size=32.0), ValueError, r"block_size must be one of \(16, 32, 64, 128, 256\), got 32.0"),
    (dict(sm_scale=-0.125), ValueError, "sm_scale must be a positive finite number"),
    (dict(config=(0, 32, 4, 1)), ValueError, "KernelConfig.block_m must be a power of two, got 0"),
    (dict(raw_config=(16, 16, 4, 1)), TypeError, "config must be a KernelConfig .*got tuple"),
    (dict(causal="no"), TypeError, "causal must be True or False, got 'no'"),
    (dict(return_lse="no"), TypeError, "return_lse must be True or False, got 'no'"),
])
def test_kernel_rejects_bad_input(change, error, match):
    d = change.get("d", 64)
    dtype = change.get("dtype", torch.float16)
    q = torch.randn(1, 2, 128, d).to(dtype)
    k = torch.randn(1, 1, change.get("k_len", 128), d).to(dtype)
    nb = change.get("mask_blocks", 4)
    mask = torch.ones(1, 2, nb, nb, dtype=torch.bool)
    with pytest.raises(error, match=match):
        config = KernelConfig(*change["config"]) if "config" in change else change.get("raw_config")
        block_sparse_attention(q, k, k, mask, block_size=change.get("block_size", 32),
                               causal=change.get("causal", True), sm_scale=change.get("sm_scale"), config=config,
                               return_lse=change.get("return_lse", False))


@pytest.mark.parametrize("change,error,match", [
    (dict(d=96), ValueError, r"head dim must be one of \(64, 128\), got 96"),
    (dict(k_dtype=torch.float32), TypeError, "q, k must share one dtype, got torch.float16, torch.float32"),
    (dict(sm_scale=0.0), ValueError, "sm_scale must be a positive finite number, got 0.0"),
    (dict(budget_divisor=True), ValueError, r"budget_divisor \(or None\) must be a positive int, got True"),
    (dict(union_vs_for_query_aware="no"), TypeError, "union_vs_for_query_aware must be True or False, got 'no'"),
    (dict(keys_per_program=0), ValueError, r"keys_per_program \(or None\) must be a positive int, got 0"),
])
def test_estimate_rejects_bad_input(change, error, match):
    d = change.get("d", 64)
    q = torch.randn(1, 2, 128, d).half()
    k = torch.randn(1, 1, 128, d).to(change.get("k_dtype", torch.float16))
    with pytest.raises(error, match=match):
        estimate_block_mask(q, k, block_size=32, sm_scale=change.get("sm_scale"),
                            budget_divisor=change.get("budget_divisor"),
                            union_vs_for_query_aware=change.get("union_vs_for_query_aware", False),
                            keys_per_program=change.get("keys_per_program"))


@pytest.mark.parametrize("batch, heads", [(0, 2), (1, 0)])
def test_flexprefill_rejects_an_empty_batch_or_head_dim(batch, heads):
    q = torch.randn(batch, heads, 64, 64).half()
    k = torch.randn(batch, heads, 64, 64).half()
    with pytest.raises(ValueError, match=r"must have non-empty dims \[B, H, N, D\]"):
        flexprefill_attention(q, k, k, gamma=0.9, block_size=32)


@pytest.mark.parametrize("gamma", [0.0, -0.1, 1.5])
def test_flexprefill_rejects_gamma_outside_unit_interval(gamma):
    q = torch.randn(1, 2, 64, 64).half()
    k = torch.randn(1, 1, 64, 64).half()
    with pytest.raises(ValueError, match=r"gamma must lie in \(0, 1\]"):
        flexprefill_attention(q, k, k, gamma=gamma, block_size=32)


# ----------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("n,hq,hkv,d", [(8192, 32, 8, 128), (8192 + 77, 9, 3, 64)])
def test_gpu_kernel_matches_reference_bf16(n, hq, hkv, d):
    q, k, v = structured_prefill(1, hq, hkv, n, d, seed=5, device="cuda")
    selection = select_blocks(q, k, gamma=0.9, tau=0.1, block_size=128, min_budget=1024)
    out, lse = block_sparse_attention(q, k, v, selection.block_mask, block_size=128, return_lse=True)
    ref, ref_lse = sparse_attention(q, k, v, selection.block_mask, 128, return_lse=True)
    bf16_torch = sparse_attention(q, k, v, selection.block_mask, 128).bfloat16()
    assert torch.isfinite(out).all()
    assert relative_error(out, ref).max() <= 3 * relative_error(bf16_torch, ref).max() + 1e-4
    assert (lse - ref_lse).abs().max() < 1e-2


@pytest.mark.gpu
def test_gpu_estimated_mask_equals_reference():
    q, k, _ = structured_prefill(1, 32, 8, 16384, 128, seed=6, device="cuda")
    for gamma in (0.9, 0.95):
        estimate = estimate_block_mask(q, k, gamma=gamma, tau=0.1, block_size=128, min_budget=1024)
        reference = select_blocks(q, k, gamma=gamma, tau=0.1, block_size=128, min_budget=1024)
        assert torch.equal(estimate.pattern, reference.pattern)
        agreement = (estimate.block_mask == reference.block_mask).float().mean().item()
        assert agreement > 0.999, agreement


@pytest.mark.gpu
def test_gpu_flexprefill_all_tiles_equals_sdpa():
    q, k, v = structured_prefill(2, 16, 4, 4096 + 50, 128, seed=7, device="cuda")
    out = flexprefill_attention(q, k, v, gamma=1.0, min_budget=1 << 20)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert relative_error(out, dense).max() < 1e-2
