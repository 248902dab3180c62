"""Retention: does the model still answer when a stopping rule runs inside every decode attention call?

The simulator's truncated output replaces the model's attention at every decode step
(query length 1) of every layer: :class:`RuleAttention` walks the layer's KV cache block by
block (:func:`~art_analysis.blockwise.blockwise_attention`), stops where the rule says
(:func:`~art_analysis.termination.stop`) and returns attention over the visited blocks
only.  The prefill, and so the first generated token, is always dense.  For retrieval prompts
(passkey, needle-in-a-haystack) :func:`compare_generation` reports, per task and rule, whether
the answer survives in the greedy output, how many tokens agree with dense decoding (the same
code path with no rule), and the KL divergence of the next-token distribution from dense
decoding's, teacher-forced on dense decoding's tokens so that every step compares the same
prefix.  This is the toolkit's stand-in for the paper's LongBench retention.

Every rule decodes the same prompt, so the rules run as the rows of one batch: the prefill
cache is repeated once per rule and row ``r`` of every decode attention call is truncated by
rule ``r`` (:class:`RuleAttention`), one model forward per step for all of them.  With
``backend="kernel"`` the ART rules that the Triton kernel runs (``group="all"``) decode instead through
``kernels.art_decode`` (:class:`art_analysis.kernel_attention.KernelAttention`: the production kernel, its plan
and its float32 recurrence, with a walk hint per layer), each rule in its own batch of one; the other rules, and
dense decoding, stay in the simulator's batch.  A kernel row equals the simulator's where the plan keeps every stop
(single walks, or followers that wait for their leader: the output is the leader's truncated one), as in the
tests' short prompts on the CPU.  It is the production plan's result otherwise, and can read more: where a walk hint
finds a layer's walks lopsided (long caches), the call takes on-demand followers and a released pair gets the
whole attention; on a GPU, a batch of one whose leader's range is shorter than the earliest stop runs the dense
walk (``kernels.split_plan.leader_can_stop``).  Its ``loaded_fraction`` and ``needle_read`` are what the kernel
loaded and kept.  ``backend="kernel_single_walk"`` runs the same kernel with every ART call in one split and no
hint (:class:`~art_analysis.kernel_attention.KernelAttention`'s ``single_walk``): each pair walks alone and stops
where the rule does at every length, so its rows test the kernel's arithmetic against the simulator's, not the
plan (rows marked ``(kernel, single walks)``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import pandas as pd
import torch
from tqdm import tqdm

from ..attention_override import override_attention
from ..capture import model_dims
from ..blockwise import blockwise_attention
from ..corpus import Prompt
from ..kernel_attention import KernelAttention, check_full_attention, visible_lengths
from ..models import cache_argument
from ..orders import KERNEL_ORDERS, ORDERS, check_token_range, walks_reading
from ..policies.quest import group_block_bounds
from ..termination import ARTConfig, Rule, stop


@dataclass
class RuleAttention:
    """An attention hook for :func:`art_analysis.attention_override.override_attention`.

    Decode calls (query length 1) truncate batch row ``r`` by ``rules[r]`` (``None``: the full walk,
    i.e. dense attention through the simulator) and record that row's loaded fraction (mean over
    query heads) in ``loaded[r]``; prefill calls run the model's own attention.  A decode mask that hides each
    row's keys past its length (a static cache) gives the walks those lengths; left padding, sliding windows and
    soft-capping are refused (:func:`art_analysis.kernel_attention.visible_lengths`).  With ``needle``
    (the ``[start, end)`` token range of a retrieval prompt's needle) every call also records in
    ``needle_read[r]`` the share of query heads whose walk read a block holding a needle token
    before it stopped.
    """

    rules: Sequence[Rule | None]
    block_size: int = 64
    order: str = "sink_recency"
    needle: tuple[int, int] | None = None
    loaded: list = field(init=False)
    needle_read: list = field(init=False)

    def __post_init__(self) -> None:
        self.rules = list(self.rules)
        if not self.rules:
            raise ValueError("RuleAttention needs one rule (or None) per batch row")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.needle is not None:
            self.needle = check_token_range(self.needle)
        self.loaded = [[] for _ in self.rules]
        self.needle_read = [[] for _ in self.rules]

    def _needle_share(self, trace, stop_step: torch.Tensor, row: int) -> float:
        """Share of row ``row``'s query heads whose steps ``0..stop_step`` include a needle block."""
        ids = trace.block_ids[row].repeat_interleave(trace.group_size, dim=0)             # [Hq, T]
        return float(walks_reading(ids, stop_step[row] + 1, self.needle, self.block_size).double().mean())

    def __call__(self, base, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[2] != 1:
            return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if query.shape[0] != len(self.rules):
            raise ValueError(f"the decode batch has {query.shape[0]} rows but {len(self.rules)} rules were given")
        check_full_attention(kwargs, "RuleAttention")
        lengths = visible_lengths(attention_mask, key.shape[0], key.shape[2], "RuleAttention")
        q = query[:, :, 0]
        block_scores = None
        if self.order == "importance":
            # Quest's key bound, max over the group: the block that could score highest comes first.
            block_scores = group_block_bounds(q, key, value, block_size=self.block_size, cache_seqlens=lengths)
        trace = blockwise_attention(q, key, value, block_size=self.block_size, order=self.order,
                                    sm_scale=scaling, block_scores=block_scores, cache_seqlens=lengths)
        output = trace.final_out.clone()
        last_step = trace.steps_per_head - 1
        for row, rule in enumerate(self.rules):
            if rule is None:
                self.loaded[row].append(1.0)
                stop_step = last_step
            else:
                result = stop(trace, rule)
                output[row] = result.output[row]
                self.loaded[row].append(float(result.loaded_fraction[row].mean()))
                stop_step = result.stop_step
            if self.needle is not None:
                self.needle_read[row].append(self._needle_share(trace, stop_step, row))
        return output.to(query.dtype)[:, None], None


def prefill(model, input_ids: Sequence[int]):
    """The dense prefill of one prompt's ``input_ids``: ``(cache, first_token)``, the model's KV cache (a
    ``DynamicCache``, for :func:`decode_rows`) and its greedy next token."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(input_ids)], device=model.device), use_cache=True, logits_to_keep=1,
                    **{cache_argument(model): cache})
    return cache, int(out.logits[0, -1].argmax())


def decode_rows(model, cache, first_tokens: Sequence[int], steps: int, hook: RuleAttention,
                forced: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``steps`` tokens for every row of a prefilled ``cache`` (consumed), greedily or, with
    ``forced`` (``first_token`` then ``steps - 1`` tokens, shared by all rows), teacher-forced.

    Returns:
        ``tokens [R, steps + 1]`` (the first tokens, then the greedy choices) and ``logprobs
        [R, steps, vocab]`` float64 (the next-token log-probabilities after each fed token).
    """
    if forced is not None and len(forced) < steps:
        raise ValueError(f"forced tokens must cover {steps} steps, got {len(forced)}")
    tokens = [torch.tensor(list(first_tokens), dtype=torch.long, device=model.device)]
    logprobs = []
    fed = tokens[0]
    cache_kwarg = {cache_argument(model): cache}
    with override_attention(model, hook, "art_rule"), torch.inference_mode():
        for step in range(steps):
            out = model(input_ids=fed[:, None], use_cache=True, logits_to_keep=1, **cache_kwarg)
            logprobs.append(torch.log_softmax(out.logits[:, -1].double(), dim=-1))
            tokens.append(logprobs[-1].argmax(-1))
            if forced is None or step + 1 >= len(forced):
                fed = tokens[-1]
            else:
                fed = torch.full_like(fed, int(forced[step + 1]))
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def _repeated(cache, rows: int):
    repeated = copy.deepcopy(cache)
    repeated.batch_repeat_interleave(rows)
    return repeated


BACKENDS = ("simulator", "kernel", "kernel_single_walk")
# the backends that decode the ART rules through the Triton kernel, and the mark of their rows
KERNEL_BACKENDS = {"kernel": " (kernel)", "kernel_single_walk": " (kernel, single walks)"}


def check_backend(backend: str, block_size: int, order: str) -> None:
    """``backend`` must be one of ``BACKENDS``, and a kernel backend walks 64-token blocks in one of
    ``KERNEL_ORDERS``; ``ValueError`` otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in KERNEL_BACKENDS and (block_size != 64 or order not in KERNEL_ORDERS):
        raise ValueError(f"the kernel backend walks 64-token blocks in order {' or '.join(KERNEL_ORDERS)}; got "
                         f"block_size={block_size}, order={order!r}")


def runs_on_kernel(rule: Rule | None) -> bool:
    """Whether ``backend="kernel"`` decodes ``rule`` through the Triton kernel: an ART rule the kernel implements
    (:meth:`~art_analysis.termination.ARTConfig.kernel_params`: ``group="all"``, named probe dims)."""
    if not isinstance(rule, ARTConfig):
        return False
    try:
        rule.kernel_params()
    except ValueError:
        return False
    return True


def _decode_rules(model, cache, first: int, steps: int, rules: Sequence[Rule | None], *, block_size: int,
                  order: str, needle: tuple[int, int] | None, backend: str,
                  forced: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """Decode ``steps`` tokens from the prefilled ``cache`` with every rule of ``rules`` (its rows in that order).

    Returns ``tokens [R, steps + 1]``, ``logprobs [R, steps, vocab]`` (as :func:`decode_rows`), and per rule the
    loaded fractions of its decode calls and their needle shares (with ``needle``)."""
    on_kernel = [r for r, rule in enumerate(rules) if backend in KERNEL_BACKENDS and runs_on_kernel(rule)]
    in_batch = [r for r in range(len(rules)) if r not in on_kernel]
    tokens, logprobs = [None] * len(rules), [None] * len(rules)
    loaded, needle_read = [[] for _ in rules], [[] for _ in rules]
    if in_batch:
        hook = RuleAttention([rules[r] for r in in_batch], block_size=block_size, order=order, needle=needle)
        batch_tokens, batch_logprobs = decode_rows(model, _repeated(cache, len(in_batch)), [first] * len(in_batch),
                                                   steps, hook, forced=forced)
        for i, r in enumerate(in_batch):
            tokens[r], logprobs[r] = batch_tokens[i], batch_logprobs[i]
            loaded[r], needle_read[r] = hook.loaded[i], hook.needle_read[i]
    for r in on_kernel:
        hook = KernelAttention(rules[r], order=order, single_walk=backend == "kernel_single_walk", needle=needle)
        row_tokens, row_logprobs = decode_rows(model, _repeated(cache, 1), [first], steps, hook, forced=forced)
        tokens[r], logprobs[r] = row_tokens[0], row_logprobs[0]
        loaded[r] = [share for shares in hook.loaded.values() for share in shares]
        needle_read[r] = [share for shares in hook.needle_read.values() for share in shares]
    return torch.stack(tokens), torch.stack(logprobs), loaded, needle_read


def compare_generation(model, tokenizer, prompts: Sequence[Prompt], rules: Mapping[str, Rule | None],
                       max_new_tokens: int = 12, block_size: int = 64, order: str = "sink_recency",
                       progress: bool = True, backend: str = "simulator") -> pd.DataFrame:
    """Generate every prompt's answer with each rule and compare with dense decoding.

    Args:
        model, tokenizer: a loaded causal LM (e.g. :func:`art_analysis.models.load_model`).
        prompts: retrieval prompts with token ids (built with the model's tokenizer).
        rules: name -> stopping rule; ``"dense"`` (``None``) is added as the reference.
        max_new_tokens: generated tokens per prompt (the first comes from the dense prefill).
        block_size, order: the walk of every decode attention call (see :class:`RuleAttention`).
        backend: ``"simulator"``, or ``"kernel"``: the ART rules that :func:`runs_on_kernel` accepts decode through
            the Triton kernel (module docstring; ``block_size`` 64, ``order`` ``"sequential"`` or
            ``"sink_recency"``; on the CPU with ``TRITON_INTERPRET=1`` set before ``triton`` is imported, and a
            model in float32 or float16), their rows named ``"<name>: <rule> (kernel)"``; or
            ``"kernel_single_walk"``: the same with every call one split (module docstring), rows marked
            ``(kernel, single walks)``.

    Returns:
        One row per ``(task, rule)`` (``task`` is the prompts' kind): ``rule, order, accuracy``
        (share of prompts whose answer appears in the generated text), ``answer_retained`` (share of
        the prompts dense decoding answers that the rule still answers), ``token_agreement`` (share of
        generated tokens equal to dense decoding's), ``first_divergence`` (mean index of the first
        differing token, ``max_new_tokens`` if none), ``kl_mean`` / ``kl_max`` (KL(dense || rule) of the
        teacher-forced next-token distributions, nats, over every step of every prompt),
        ``loaded_fraction`` (mean over layers, decode steps and prompts of the free-running decode),
        ``needle_read`` (share of query heads, over the same calls, whose walk read the needle's
        block before stopping), ``prompts``.
    """
    if max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be >= 2 (the first token comes from the prefill), got {max_new_tokens}")
    if not prompts:
        raise ValueError("compare_generation needs at least one prompt")
    if any(p.input_ids is None for p in prompts):
        raise ValueError("prompts must carry input_ids: build them with the model's tokenizer")
    max_positions = model_dims(model)["max_position_embeddings"]
    longest = max(len(p.input_ids) for p in prompts)
    if max_positions and longest + max_new_tokens - 1 > max_positions:
        raise ValueError(f"a prompt of {longest} tokens and {max_new_tokens} new tokens take "
                         f"{longest + max_new_tokens - 1} positions, past the model's maximum "
                         f"(max_position_embeddings={max_positions})")
    check_backend(backend, block_size, order)
    rules = {"dense": None, **{name: rule for name, rule in rules.items() if name != "dense"}}
    names, steps = list(rules), max_new_tokens - 1
    walk = dict(block_size=block_size, order=order, backend=backend)
    records = []
    for prompt in tqdm(prompts, desc=f"retention ({order})", leave=False, disable=not progress):
        cache, first = prefill(model, prompt.input_ids)
        needle = (prompt.needle_start, prompt.needle_end) if prompt.unit == "tokens" else None
        tokens, logprobs, loaded, needle_read = _decode_rules(model, cache, first, steps, list(rules.values()),
                                                              needle=needle, **walk)
        dense = tokens[0]
        # Rows that left dense decoding's path are replayed teacher-forced on it for the KL.
        diverged = [r for r in range(1, len(names)) if not torch.equal(tokens[r], dense)]
        if diverged:
            _, logprobs[diverged], _, _ = _decode_rules(model, cache, first, steps, [rules[names[r]] for r in diverged],
                                                        needle=None, forced=dense.tolist(), **walk)
        kl = (logprobs[0].exp() * (logprobs[0] - logprobs)).sum(-1).clamp(min=0)          # [R, steps]
        dense_correct = prompt.answer in tokenizer.decode(dense.tolist())
        for r, name in enumerate(names):
            same = (tokens[r] == dense).tolist()
            correct = prompt.answer in tokenizer.decode(tokens[r].tolist())
            records.append(dict(task=prompt.kind, rule=name, correct=correct,
                                dense_correct=dense_correct, agree=sum(same),
                                divergence=same.index(False) if False in same else max_new_tokens,
                                kl=kl[r], loaded=loaded[r], needle_read=needle_read[r]))
    rows = []
    for task in dict.fromkeys(r["task"] for r in records):
        for name, rule in rules.items():
            group = [r for r in records if r["task"] == task and r["rule"] == name]
            kl = torch.cat([r["kl"] for r in group])
            loaded = [x for r in group for x in r["loaded"]]
            needle_read = [x for r in group for x in r["needle_read"]]
            answered = [r for r in group if r["dense_correct"]]
            label = name if rule is None else f"{name}: {rule.name}"
            if backend in KERNEL_BACKENDS and runs_on_kernel(rule):
                label += KERNEL_BACKENDS[backend]
            rows.append(dict(task=task, rule=label, order=order,
                             accuracy=sum(r["correct"] for r in group) / len(group),
                             answer_retained=(sum(r["correct"] for r in answered) / len(answered)
                                              if answered else float("nan")),
                             token_agreement=sum(r["agree"] for r in group) / (len(group) * max_new_tokens),
                             first_divergence=sum(r["divergence"] for r in group) / len(group),
                             kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                             loaded_fraction=sum(loaded) / len(loaded),
                             needle_read=sum(needle_read) / len(needle_read) if needle_read else float("nan"),
                             prompts=len(group)))
    return pd.DataFrame(rows)


GENERATION_COLUMNS = ("task", "rule", "order", "accuracy", "answer_retained", "token_agreement", "first_divergence",
                      "kl_mean", "kl_max", "loaded_fraction", "needle_read", "prompts")
GENERATION_FORMATS = {"accuracy": ".2f", "answer_retained": ".2f", "token_agreement": ".3f",
                      "first_divergence": ".1f", "kl_mean": ".2e", "kl_max": ".2e", "loaded_fraction": ".3f",
                      "needle_read": ".3f"}
