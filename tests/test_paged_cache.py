"""``kernels.paged_cache.to_paged``: the pages hold the cache, in a shuffled order, and bad input is refused."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_cache import to_paged


@pytest.mark.parametrize("seqlen, page_size", [(64, 16), (70, 16), (5, 1), (33, 64)])
def test_pages_gathered_through_the_table_give_back_the_cache(seqlen, page_size):
    k = torch.randn(3, 2, seqlen, 8, dtype=torch.float16)
    v = torch.randn(3, 2, seqlen, 8, dtype=torch.float16)
    k_pages, v_pages, table = to_paged(k, v, page_size, seed=5)
    per_seq = -(-seqlen // page_size)
    assert table.dtype == torch.int32 and tuple(table.shape) == (3, per_seq)
    assert tuple(k_pages.shape) == (3 * per_seq + 3, page_size, 2, 8) and k_pages.dtype == torch.float16
    assert torch.unique(table).numel() == table.numel()  # no page owned twice
    for pages, x in ((k_pages, k), (v_pages, v)):
        gathered = pages[table.long()].permute(0, 3, 1, 2, 4).reshape(3, 2, per_seq * page_size, 8)
        assert torch.equal(gathered[:, :, :seqlen], x)


def test_the_page_order_is_shuffled_and_fixed_by_the_seed():
    k = torch.randn(4, 1, 256, 4)
    first, again, other = (to_paged(k, k, 16, seed=s)[2] for s in (1, 1, 2))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.equal(first.flatten(), torch.arange(first.numel(), dtype=torch.int32))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(page_size=0), ValueError, "page_size must be a positive int"),
    (dict(page_size=True), ValueError, "page_size must be a positive int"),
    (dict(page_size=16, spare_pages=-1), ValueError, "spare_pages must be an int >= 0"),
])
def test_bad_page_arguments_are_refused(kwargs, error, message):
    k = torch.randn(1, 1, 32, 4)
    with pytest.raises(error, match=message):
        to_paged(k, k, **kwargs)


def test_mismatched_caches_are_refused():
    k = torch.randn(1, 1, 32, 4)
    with pytest.raises(ValueError, match=r"\[B, Hkv, S, D\]"):
        to_paged(k, k[:, :, :16], 16)
    with pytest.raises(ValueError, match="share dtype and device"):
        to_paged(k, k.half(), 16)
    with pytest.raises(TypeError, match="must be tensors"):
        to_paged(k, None, 16)
