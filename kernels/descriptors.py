"""Tensor descriptors (TMA bulk copies on Hopper) for the Triton kernels: when a tensor can be read
through one, descriptors made on the host, and the allocator that Triton needs for descriptors made
inside a kernel.

A kernel that calls ``tl.make_tensor_descriptor`` asks the host, at launch, for a global scratch
buffer to hold the descriptors; :func:`set_descriptor_allocator` gives Triton one from PyTorch's
caching allocator (process-wide, set once, also inside CUDA-graph capture, where the buffer
comes from the graph's pool).  The CPU interpreter needs none.
"""
from __future__ import annotations

from functools import cache

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor


def descriptor_ready(x: torch.Tensor) -> bool:
    """Whether a descriptor can address ``x`` along its last dim: unit last stride, and a 16-byte
    aligned base and other strides (the bulk-copy engine's requirements), none of them 0 along a dim of more than
    one entry (an expanded tensor, e.g. one cache shared by a batch, is read through pointers)."""
    size = x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(stride * size % 16 == 0 and (stride > 0 or extent == 1)
                    for stride, extent in zip(x.stride()[:-1], x.shape[:-1])))


def host_descriptor(x: torch.Tensor, block_rows: int, rows: int | None = None) -> TensorDescriptor:
    """A descriptor made on the host of ``x [B, H, N, D]`` reading ``[1, 1, block_rows, D]`` blocks; the rows
    at or past ``rows`` (default ``N``) read as zeros.  Passed by value, so the kernel builds none."""
    shape = list(x.shape)
    if rows is not None:
        shape[2] = rows
    return TensorDescriptor(x, shape=shape, strides=list(x.stride()), block_shape=[1, 1, block_rows, x.shape[-1]])


def page_descriptor(pages: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """A descriptor made on the host of a paged cache ``pages [num_pages, page_size, Hkv, D]`` reading
    ``[1, block_rows, 1, D]`` blocks: one head's consecutive slots of one page."""
    return TensorDescriptor(pages, shape=list(pages.shape), strides=list(pages.stride()),
                            block_shape=[1, block_rows, 1, pages.shape[-1]])


def prepare_descriptors(device: torch.device) -> None:
    """Make kernels that build descriptors launchable on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        set_descriptor_allocator()


@cache
def set_descriptor_allocator() -> None:
    """Register a PyTorch-backed allocator for in-kernel descriptors (once per process)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
