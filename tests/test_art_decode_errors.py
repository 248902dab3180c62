"""`kernels.art_decode` rejects bad input at its boundary with a clear error (checked before any launch)."""
from __future__ import annotations

import pytest
import torch

from art_analysis.termination import ARTConfig
from kernels.art_decode import art_decode
from kernels.art_params import ARTParams


def _inputs(batch=2, q_heads=4, kv_heads=2, seqlen=64, dim=64, dtype=torch.float16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, q_heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_heads, seqlen, dim, generator=gen).to(dtype)
    return q, k, k.clone()


def _paged(num_pages=6, page_size=16, kv_heads=2, dim=64):
    pages = torch.randn(num_pages, page_size, kv_heads, dim).half()
    return pages, pages.clone(), torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)


CASES = {
    "q not a tensor": (lambda q, k, v: ((q.tolist(), k, v), {}), TypeError, "q must be a torch.Tensor"),
    "integer dtype": (lambda q, k, v: ((q.int(), k, v), {}), TypeError, "float16, bfloat16 or float32"),
    "mixed dtypes": (lambda q, k, v: ((q, k.float(), v.float()), {}), TypeError, "share one dtype"),
    "q rank": (lambda q, k, v: ((q[None], k, v), {}), ValueError, r"q must be \[B, Hq, D\]"),
    "k rank": (lambda q, k, v: ((q, k[0], v[0]), {}), ValueError, r"k_cache must be \[B, Hkv, S, D\]"),
    "v shape": (lambda q, k, v: ((q, k, v[:, :, :32]), {}), ValueError, "v_cache must have the shape of k_cache"),
    "head dim 32": (lambda q, k, v: ((q[..., :32], k[..., :32], v[..., :32]), {}), ValueError,
                    r"head dim D must be one of \(64, 128\)"),
    "head dim mismatch": (lambda q, k, v: ((torch.cat([q, q], -1), k, v), {}), ValueError, "head dim mismatch"),
    "Hq % Hkv": (lambda q, k, v: ((q[:, :3], k, v), {}), ValueError, r"Hq % Hkv must be 0"),
    "batch mismatch": (lambda q, k, v: ((q[:1], k, v), {}), ValueError, "contiguous k_cache must be"),
    "empty batch": (lambda q, k, v: ((q[:0], k[:0], v[:0]), {}), ValueError, "at least one sequence"),
    "no query head": (lambda q, k, v: ((q[:, :0], k, v), {}), ValueError, "and one query head"),
    "no kv head": (lambda q, k, v: ((q, k[:, :0], v[:, :0]), {}), ValueError,
                   r"contiguous \[B, Hkv, S, D\] k_cache \(2, 0, 64, 64\) holds no KV head"),
    "strided head dim": (lambda q, k, v: ((q, k.transpose(2, 3).contiguous().transpose(2, 3), v), {}),
                         ValueError, "unit stride in the head dim"),
    "order": (lambda q, k, v: ((q, k, v), {"order": "importance"}), ValueError, "order must be one of"),
    "block size": (lambda q, k, v: ((q, k, v), {"block_size": 48}), ValueError, "block_size must be one of"),
    "num_splits": (lambda q, k, v: ((q, k, v), {"num_splits": 0}), ValueError, "num_splits must be an int"),
    "sm_scale": (lambda q, k, v: ((q, k, v), {"sm_scale": -1.0}), ValueError, "sm_scale must be a positive"),
    "longest stop zero": (lambda q, k, v: ((q, k, v), {"longest_stop_steps": 0}), ValueError,
                          r"longest_stop_steps must be an int in \[1, 1048576\] \(blocks\)"),
    "longest stop float": (lambda q, k, v: ((q, k, v), {"longest_stop_steps": 40.0}), ValueError,
                           r"longest_stop_steps must be an int in \[1, 1048576\] \(blocks\)"),
    "follow step negative": (lambda q, k, v: ((q, k, v), {"follow_step": -1}), ValueError,
                             r"follow_step must be an int in \[0, 1048576\] \(blocks\)"),
    "follow step bool": (lambda q, k, v: ((q, k, v), {"follow_step": True}), ValueError,
                         r"follow_step must be an int in \[0, 1048576\] \(blocks\)"),
    "follow step past any walk": (lambda q, k, v: ((q, k, v), {"follow_step": 2 ** 62}), ValueError,
                                  r"follow_step must be an int in \[0, 1048576\]"),
    "release walks past int32": (lambda q, k, v: ((q, k, v), {"art": ARTParams(), "release_walks": 2 ** 64}),
                                 ValueError, r"release_walks must be an int in \[0, 2147483647\] \(pairs\)"),
    "walk hint type": (lambda q, k, v: ((q, k, v), {"walk_hint": 40}), TypeError, "walk_hint must be a"),
    "return flag as a string": (lambda q, k, v: ((q, k, v), {"return_stats": "no"}), TypeError,
                                "return_stats must be True or False, got 'no'"),
    "return flag as an int": (lambda q, k, v: ((q, k, v), {"return_lse": 1}), TypeError,
                              "return_lse must be True or False, got 1"),
    "art config type": (lambda q, k, v: ((q, k, v), {"art": ARTConfig()}), TypeError, "kernel_params"),
    "seqlens float": (lambda q, k, v: ((q, k, v), {"cache_seqlens": torch.tensor([3.0, 4.0])}), TypeError,
                      "int32 or int64"),
    "seqlens shape": (lambda q, k, v: ((q, k, v), {"cache_seqlens": torch.tensor([3], dtype=torch.int32)}),
                      ValueError, r"shape \[B\]"),
    "seqlens zero": (lambda q, k, v: ((q, k, v), {"cache_seqlens": torch.tensor([0, 4], dtype=torch.int32)}),
                     ValueError, "must be >= 1"),
    "seqlens beyond capacity": (lambda q, k, v: ((q, k, v), {"cache_seqlens": torch.tensor([65, 4])}),
                                ValueError, "beyond the capacity of 64 tokens"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_contiguous_input_is_rejected(name):
    make, error, message = CASES[name]
    args, kwargs = make(*_inputs())
    with pytest.raises(error, match=message):
        art_decode(*args, **kwargs)


def test_block_table_too_short_is_rejected():
    q, _, _ = _inputs()
    k_pages, v_pages, table = _paged()
    with pytest.raises(ValueError, match="block_table too short"):
        art_decode(q, k_pages, v_pages, block_table=table, cache_seqlens=torch.tensor([49, 10]))


def test_block_table_with_a_bad_page_id_is_rejected():
    q, _, _ = _inputs()
    k_pages, v_pages, table = _paged()
    table[1, 1] = 6
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 6 is not a page id in \[0, 6\)"):
        art_decode(q, k_pages, v_pages, block_table=table, cache_seqlens=torch.tensor([48, 20]))


@pytest.mark.parametrize("bad, error, message", [
    ("float", TypeError, "block_table must be int32 or int64"),
    ("rows", ValueError, r"block_table must be \[B=2, max_pages\]"),
    ("layout", ValueError, r"k_cache must be \[num_pages, page_size, Hkv, D\]"),
    # a contiguous cache passed with a table is read as pages: the error names the layout it was read as
    ("contiguous", ValueError, r"Hkv=64 from the paged \[num_pages, page_size, Hkv, D\] k_cache \(2, 2, 64, 64\)"),
])
def test_bad_paged_layout_is_rejected(bad, error, message):
    q, _, _ = _inputs()
    k_pages, v_pages, table = _paged()
    if bad == "float":
        table = table.float()
    elif bad == "rows":
        table = table[:1]
    elif bad == "layout":
        k_pages, v_pages = k_pages[0], v_pages[0]
    else:
        _, k_pages, v_pages = _inputs()
    with pytest.raises(error, match=message):
        art_decode(q, k_pages, v_pages, block_table=table)


@pytest.mark.gpu
def test_gpu_tensors_must_share_one_device():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="must be on one device"):
        art_decode(q.cuda(), k, v)


def test_an_empty_cache_is_rejected():
    q = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="holds no token"):
        art_decode(q, torch.randn(1, 1, 0, 64), torch.randn(1, 1, 0, 64))
    with pytest.raises(ValueError, match="at least one page"):
        art_decode(q, torch.randn(4, 0, 1, 64), torch.randn(4, 0, 1, 64),
                   block_table=torch.zeros(1, 2, dtype=torch.int32))


def test_an_art_walk_longer_than_the_kernel_supports_is_rejected(monkeypatch):
    import kernels.art_decode as art_decode_module

    monkeypatch.setattr(art_decode_module, "MAX_ART_STEPS", 2)
    q, k, v = _inputs(seqlen=192)                                    # 3 blocks of 64
    with pytest.raises(ValueError, match="an ART walk is at most 2 blocks"):
        art_decode(q, k, v, art=ARTConfig().kernel_params())
    art_decode(q, k, v, art=ARTConfig().kernel_params(), block_size=128)   # 2 blocks of 128
    art_decode(q, k, v)                                              # dense walks have no such limit


def test_lengths_are_read_and_checked_outside_a_graph_capture_only():
    from kernels.art_decode import _check_seqlens

    lengths = torch.tensor([0, 99], dtype=torch.int64)
    with pytest.raises(ValueError, match=">= 1"):
        _check_seqlens(lengths, 2, 64, "S", torch.device("cpu"))
    # inside a capture nothing can be read back: the values pass, the grid is sized for the capacity
    seqlens, max_len = _check_seqlens(lengths, 2, 64, "S", torch.device("cpu"), read_values=False)
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [0, 99] and max_len == 64
    with pytest.raises(ValueError, match=r"shape \[B\]=\[3\]"):
        _check_seqlens(lengths, 3, 64, "S", torch.device("cpu"), read_values=False)
