"""Run a function in place of a transformers model's attention, keeping its causal mask.

transformers (>= 4.48) dispatches attention through a registry of attention functions
``fn(module, query [B, Hq, q_len, D], key [B, Hkv, S, D], value, attention_mask, **kwargs) ->
(out [B, q_len, Hq, D], weights)``.  :func:`override_attention` registers a wrapper under a
new name, with the model's own mask function, switches the model to it, and restores the
original implementation on exit.  The wrapped callable receives the model's own attention
function first, so it can record, replace or fall back to it::

    def hook(base, module, query, key, value, attention_mask, **kwargs):
        return base(module, query, key, value, attention_mask, **kwargs)

    with override_attention(model, hook, "my_hook"):
        model(input_ids)

``query`` is post-RoPE, ``key``/``value`` are the cache contents after the current tokens
were appended.
"""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Callable, Iterator


def model_attention_function(module, implementation: str) -> Callable:
    """The attention function ``implementation`` (``"sdpa"``, ``"eager"``, ...) for ``module``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    # "eager" is defined by each model's own modelling file.
    return importlib.import_module(type(module).__module__).eager_attention_forward


@contextmanager
def override_attention(model, hook: Callable, tag: str) -> Iterator[str]:
    """Route ``model``'s attention through ``hook(base, module, query, key, value, mask, **kwargs)``.

    Yields the name of the model's own implementation, which is restored on exit.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {base!r} has no mask function; load the model with "
                         f"attn_implementation='sdpa' or 'eager'")

    def attention(module, query, key, value, attention_mask, **kwargs):
        return hook(model_attention_function(module, base), module, query, key, value, attention_mask, **kwargs)

    name = f"{tag}_{base}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    try:
        yield base
    finally:
        model.set_attn_implementation(base)
