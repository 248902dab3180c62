"""End to end: greedy generation with a stopping rule inside every decode attention call.

The simulator's truncated output replaces the model's attention at every decode step
(query length 1) of every layer: :class:`RuleAttention` walks the layer's KV cache block by
block (:func:`~art_analysis.blockwise.blockwise_attention`), stops where the rule says
(:func:`~art_analysis.termination.stop`) and returns attention over the visited blocks
only.  The prefill, and so the first generated token, is always dense.  Comparing the tokens
with those of dense decoding (the same code path with no rule) and checking retrieval
answers (passkey, needle-in-a-haystack) measures what a stopping rule costs in model output,
not only in attention error.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from tqdm import tqdm

from ..attention_override import override_attention
from ..blockwise import blockwise_attention
from ..corpus import Prompt
from ..models import cache_argument
from ..policies.quest import block_score_bounds
from ..termination import Rule, stop


@dataclass
class RuleAttention:
    """An attention hook for :func:`art_analysis.attention_override.override_attention`.

    Decode calls (query length 1, batch 1) return the rule's truncated output and record the
    loaded fraction (mean over query heads) per call; prefill calls run the model's own
    attention.  ``rule=None`` runs the full walk (dense decoding through the simulator).
    """

    rule: Rule | None
    block_size: int = 64
    order: str = "sink_recency"
    loaded: list = field(default_factory=list)

    def __call__(self, base, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] != 1:
            return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if query.shape[0] != 1:
            raise ValueError("end-to-end evaluation decodes one sequence at a time (batch 1)")
        q = query[:, :, 0]
        block_scores = None
        if self.order == "importance":
            # Quest's key bound, max over the group: the block that could score highest comes first.
            bounds = block_score_bounds(q, key, value, block_size=self.block_size)
            block_scores = bounds.view(bounds.shape[0], key.shape[1], -1, bounds.shape[-1]).amax(2)
        trace = blockwise_attention(q, key, value, block_size=self.block_size, order=self.order,
                                    sm_scale=scaling, block_scores=block_scores)
        if self.rule is None:
            output = trace.final_out
            self.loaded.append(1.0)
        else:
            result = stop(trace, self.rule)
            output = result.output
            self.loaded.append(float(result.loaded_fraction.mean()))
        return output.to(query.dtype)[:, None], None


def greedy_continuation(model, cache, first_token: torch.Tensor, steps: int, hook: RuleAttention) -> list[int]:
    """Decode ``steps`` tokens greedily after ``first_token`` ([1] long) from a prefilled ``cache``."""
    tokens = [int(first_token)]
    cache_kwarg = {cache_argument(model): cache}
    with override_attention(model, hook, "art_rule"), torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, logits_to_keep=1, **cache_kwarg)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def compare_generation(model, tokenizer, prompts: Sequence[Prompt], rules: Mapping[str, Rule | None],
                       max_new_tokens: int = 12, block_size: int = 64, order: str = "sink_recency") -> list[dict]:
    """Generate every prompt's answer with each rule and compare with dense decoding.

    Args:
        model, tokenizer: a loaded causal LM (e.g. :func:`art_analysis.models.load_model`).
        prompts: retrieval prompts with token ids (built with the model's tokenizer).
        rules: name -> stopping rule; ``"dense"`` (``None``) is added as the reference.
        max_new_tokens: generated tokens per prompt (the first comes from the dense prefill).
        block_size, order: the walk of every decode attention call (see :class:`RuleAttention`).

    Returns:
        One row per rule: ``rule, order, accuracy`` (share of prompts whose answer appears in the
        generated text), ``token_agreement`` (share of generated tokens equal to dense decoding),
        ``first_divergence`` (mean index of the first token that differs, ``max_new_tokens`` if
        none), ``loaded_fraction`` (mean over layers, decode steps and prompts), ``prompts``.
    """
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (the first token comes from the prefill), got {max_new_tokens}")
    if not prompts:
        raise ValueError("compare_generation needs at least one prompt")
    if any(p.input_ids is None for p in prompts):
        raise ValueError("prompts must carry input_ids: build them with the model's tokenizer")
    rules = {"dense": None, **{name: rule for name, rule in rules.items() if name != "dense"}}
    stats = {name: dict(correct=0, agree=0, divergence=0, loaded=[]) for name in rules}
    from transformers import DynamicCache

    for prompt in tqdm(prompts, desc="prompts", leave=False):
        cache = DynamicCache()
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([prompt.input_ids]), use_cache=True, logits_to_keep=1,
                        **{cache_argument(model): cache})
        first = out.logits[0, -1].argmax()
        reference = None
        for name, rule in rules.items():
            hook = RuleAttention(rule, block_size=block_size, order=order)
            tokens = greedy_continuation(model, copy.deepcopy(cache), first, max_new_tokens - 1, hook)
            reference = tokens if reference is None else reference
            same = [a == b for a, b in zip(tokens, reference)]
            entry = stats[name]
            entry["correct"] += prompt.answer in tokenizer.decode(tokens)
            entry["agree"] += sum(same)
            entry["divergence"] += same.index(False) if False in same else max_new_tokens
            entry["loaded"].extend(hook.loaded)
    count = len(prompts)
    return [dict(rule=name if rules[name] is None else f"{name}: {rules[name].name}", order=order,
                 accuracy=entry["correct"] / count, token_agreement=entry["agree"] / (count * max_new_tokens),
                 first_divergence=entry["divergence"] / count,
                 loaded_fraction=sum(entry["loaded"]) / len(entry["loaded"]), prompts=count)
            for name, entry in stats.items()]


GENERATION_COLUMNS = ("rule", "order", "accuracy", "token_agreement", "first_divergence", "loaded_fraction", "prompts")
GENERATION_FORMATS = {"accuracy": ".2f", "token_agreement": ".3f", "first_divergence": ".1f",
                      "loaded_fraction": ".3f"}
