"""ART and the baseline stopping rules, evaluated on a :class:`~art_analysis.blockwise.BlockTrace`.

**ART** (DESIGN §5).  After step ``t`` the probe ``x^(t)`` is the partial output ``O^(t)``
(``probe_source="output"``) or the un-normalised accumulator ``acc^(t)``
(``"accumulator"``), restricted to the probe dims (``"full"``; ``"mma"``: dims with
``d % 8 in {0, 1}``, the ones an ``m16n8k16`` accumulator fragment of one thread holds; or
an explicit index tensor).  With ``n_t = ||x^(t)||``::

    d_scale^(t) = | n_t - n_{t-1} |            (/ max(n_{t-1}, 1e-30) if scale == "relative")
    d_dir^(t)   = 1 - <x^(t), x^(t-1)> / max(n_t n_{t-1}, 1e-30)

Step ``t >= max(1, min_steps)`` is *stable* when ``d_scale < tau`` (if ``use_scale``) and
``d_dir < phi`` (if ``use_direction``).  A per-head counter rises on a stable step and
resets to 0 on an unstable one; a head is done after the step at which the counter
reaches ``patience`` (and stays done).  With ``group="head"`` each query head stops there;
with ``group="all"`` (the kernel's rule: one program serves every query head of a KV head)
all heads of a group stop at the step at which the last of them is done.  A walk that
never stops visits every block.

**Baselines.**  :class:`Oracle` (first step after which the true relative error stays
``<= eps``), :class:`MassCoverage` (first step at which the visited blocks hold ``gamma``
of the softmax mass: FlexPrefill's key-centric coverage rule) and :class:`FixedBudget`.

:func:`stop` evaluates one rule; :func:`sweep` evaluates many over one trace, computing
each probe's norms and dot products once; :func:`kernel_walk_steps` turns a ``group="all"`` result into
the blocks each ``(b, kv_head)``'s kernel program loads, and :func:`replay_kernel_walks` replays a
single-split kernel call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .blockwise import BlockTrace, blockwise_attention
from kernels.art_params import check_switches, check_threshold

from .checks import check_fraction, check_int
from .orders import KERNEL_ORDERS

PROBE_SOURCES = ("output", "accumulator")
PROBE_DIM_NAMES = ("full", "mma")
SCALES = ("relative", "absolute")
GROUPS = ("all", "head")
_TINY = 1e-30


def _check_group(group: str) -> None:
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")


def mma_probe_dims(head_dim: int) -> torch.Tensor:
    """Head dims one thread holds of an ``m16n8k16`` fp32 accumulator: ``d % 8 in {0, 1}`` (``D/4`` dims)."""
    dims = torch.arange(head_dim)
    return dims[(dims % 8) <= 1]


@dataclass(frozen=True, eq=False)
class ARTConfig:
    """ART stopping rule (see the module docstring for the exact definition).

    Attributes:
        tau: scale-change threshold (``d_scale < tau`` is stable).
        phi: direction-change threshold on ``1 - cos`` (``d_dir < phi`` is stable).
        patience: consecutive stable steps needed to stop.
        min_steps: steps ``t < min_steps`` never count (default 1: the sink block).
        probe_source: ``"output"`` or ``"accumulator"``.
        probe_dims: ``"full"``, ``"mma"`` or a ``LongTensor`` of head dims.
        scale: ``"relative"`` or ``"absolute"`` scale change.
        group: ``"all"`` (every head of a KV group must be done; the kernel's rule) or
            ``"head"`` (each query head stops on its own; analysis only).
        use_scale, use_direction: ablation switches for the two tests.

    ``ARTConfig()`` holds this project's defaults (see ``figures/REPORT.md``);
    ``ARTConfig.paper()`` the values the paper's secondary summaries report.
    """

    tau: float = 1e-2
    phi: float = 1e-6
    patience: int = 16
    min_steps: int = 1
    probe_source: str = "output"
    probe_dims: Union[str, torch.Tensor] = "full"
    scale: str = "relative"
    group: str = "all"
    use_scale: bool = True
    use_direction: bool = True

    def __post_init__(self) -> None:
        for name in ("tau", "phi"):
            object.__setattr__(self, name, check_threshold(getattr(self, name), name))
        object.__setattr__(self, "patience", check_int(self.patience, "patience", 1))
        object.__setattr__(self, "min_steps", check_int(self.min_steps, "min_steps", 0))
        if self.probe_source not in PROBE_SOURCES:
            raise ValueError(f"probe_source must be one of {PROBE_SOURCES}, got {self.probe_source!r}")
        if isinstance(self.probe_dims, torch.Tensor):
            if self.probe_dims.dtype not in (torch.int64, torch.int32) or self.probe_dims.dim() != 1 \
                    or self.probe_dims.numel() == 0:
                raise ValueError("explicit probe_dims must be a non-empty 1-D integer tensor of head dims")
        elif not isinstance(self.probe_dims, str) or self.probe_dims not in PROBE_DIM_NAMES:
            raise ValueError(f"probe_dims must be one of {PROBE_DIM_NAMES} or an index tensor, "
                             f"got {self.probe_dims!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        _check_group(self.group)
        check_switches(self, ("use_scale", "use_direction"))

    @classmethod
    def paper(cls, **overrides) -> "ARTConfig":
        """``tau=1e-7, phi=1e-3, patience=5``, accumulator probe, absolute scale."""
        settings = dict(tau=1e-7, phi=1e-3, patience=5, probe_source="accumulator", scale="absolute")
        settings.update(overrides)
        return cls(**settings)

    @property
    def name(self) -> str:
        parts = [f"tau={self.tau:g}", f"phi={self.phi:g}", f"p={self.patience}"]
        if not self.use_scale:
            parts.append("no_scale")
        if not self.use_direction:
            parts.append("no_direction")
        dims = self.probe_dims if isinstance(self.probe_dims, str) else f"{self.probe_dims.numel()}dims"
        return f"ART({', '.join(parts)}, {self.probe_source}/{dims}/{self.scale}/{self.group})"

    def kernel_params(self):
        """The same rule as :class:`kernels.art_params.ARTParams` for ``kernels.art_decode``."""
        from kernels.art_params import ARTParams

        if self.group != "all":
            raise ValueError("the kernel stops a program only when every head of the group is done: "
                             "use group='all'")
        if not isinstance(self.probe_dims, str):
            raise ValueError("the kernel supports probe_dims 'full' and 'mma', not an explicit index tensor")
        return ARTParams(tau=float(self.tau), phi=float(self.phi), patience=self.patience,
                         min_steps=self.min_steps, probe_source=self.probe_source,
                         probe_dims=self.probe_dims, scale=self.scale, use_scale=self.use_scale,
                         use_direction=self.use_direction)


@dataclass(frozen=True)
class Oracle:
    """Stop at the first step after which ``||O^(u) - O|| / ||O|| <= eps`` for every later ``u``."""

    eps: float
    group: str = "head"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_threshold(self.eps, "eps"))
        _check_group(self.group)

    @property
    def name(self) -> str:
        return f"Oracle(eps={self.eps:g}, {self.group})"


@dataclass(frozen=True)
class MassCoverage:
    """Stop once the visited blocks hold ``gamma`` of the softmax mass (key-centric coverage)."""

    gamma: float
    group: str = "head"

    def __post_init__(self) -> None:
        object.__setattr__(self, "gamma", check_fraction(self.gamma, "gamma"))
        _check_group(self.group)

    @property
    def name(self) -> str:
        return f"MassCoverage(gamma={self.gamma:g}, {self.group})"


@dataclass(frozen=True)
class FixedBudget:
    """Visit the first ``steps`` blocks of the order."""

    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", check_int(self.steps, "steps", 1))

    @property
    def name(self) -> str:
        return f"FixedBudget(steps={self.steps})"


Rule = Union[ARTConfig, Oracle, MassCoverage, FixedBudget]


@dataclass
class StopResult:
    """Where a rule stops and what that costs.

    Attributes:
        stop_step: ``[B, Hq]`` last step visited.
        output: ``[B, Hq, D]`` attention over the visited blocks only.
        loaded_fraction: ``[B, Hq]`` visited tokens over the tokens of the whole walk.
        rel_error: ``[B, Hq]`` ``||output - final_out|| / ||final_out||``.
        cos_error: ``[B, Hq]`` ``1 - cos(output, final_out)``.
        group_size: the trace's query heads per KV head (``Hq / Hkv``).
    """

    stop_step: torch.Tensor
    output: torch.Tensor
    loaded_fraction: torch.Tensor
    rel_error: torch.Tensor
    cos_error: torch.Tensor
    group_size: int


@dataclass
class SweepResult:
    """Many rules over one trace: tensors are ``[R, B, Hq]`` in the order of ``rules``."""

    rules: list
    stop_step: torch.Tensor
    loaded_fraction: torch.Tensor
    rel_error: torch.Tensor
    cos_error: torch.Tensor

    def rows(self) -> list[dict]:
        """One row per rule and head: ``rule, b, head, stop_step, loaded_fraction, rel_error, cos_error``."""
        out = []
        _, batch, heads = self.stop_step.shape
        for r, rule in enumerate(self.rules):
            for b in range(batch):
                for h in range(heads):
                    out.append(dict(rule=rule.name, b=b, head=h,
                                    stop_step=int(self.stop_step[r, b, h]),
                                    loaded_fraction=float(self.loaded_fraction[r, b, h]),
                                    rel_error=float(self.rel_error[r, b, h]),
                                    cos_error=float(self.cos_error[r, b, h])))
        return out


def stop(trace: BlockTrace, rule: Rule) -> StopResult:
    """Evaluate one stopping rule on a trace."""
    return _result(trace, _Evaluator(trace).stop_steps(rule))


def kernel_walk_steps(result: StopResult, kv_heads: int) -> torch.Tensor:
    """Blocks the kernel's single-split program of each ``(b, kv_head)`` loads: ``[B, Hkv]`` int64, the group's
    stop step + 1, for a ``result`` of a rule with ``group="all"`` (the kernel's rule: every query head of a
    KV head stops at one step) on a trace with ``kv_heads`` KV heads."""
    if not isinstance(result, StopResult):
        raise TypeError(f"result must be the StopResult of `stop`, got {type(result).__name__}")
    kv_heads = check_int(kv_heads, "kv_heads", 1)
    batch, q_heads = result.stop_step.shape
    if kv_heads * result.group_size != q_heads:
        raise ValueError(f"kv_heads must be the trace's {q_heads // result.group_size} KV heads ({q_heads} query "
                         f"heads in groups of {result.group_size}), got {kv_heads!r}")
    grouped = result.stop_step.view(batch, kv_heads, q_heads // kv_heads)
    if not bool((grouped == grouped[..., :1]).all()):
        raise ValueError("the query heads of a KV head stop at different steps: use a rule with group='all'")
    return grouped[..., 0] + 1


def art_or_default(art: ARTConfig | None) -> ARTConfig:
    """``art``, or ``ARTConfig()`` for ``None``; ``TypeError`` for anything else (a study's stopping rule)."""
    if art is not None and not isinstance(art, ARTConfig):
        raise TypeError(f"art must be an ARTConfig (or None for ARTConfig()), got {type(art).__name__}")
    return art or ARTConfig()


def replay_kernel_walks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: ARTConfig, *, block_size: int = 64,
                        order: str = "sink_recency", sm_scale: float | None = None) -> torch.Tensor:
    """The simulator's replay of the kernel's single-split walks on ``q [B, Hq, D]``, ``k, v [B, Hkv, S, D]``
    (kernel mode: fp32 recurrence, ``p`` rounded to the value dtype) at softmax scale ``sm_scale`` (default
    ``D ** -0.5``): the blocks each ``(b, kv_head)`` loads under ``rule`` (``group="all"``), ``[B, Hkv]`` int64.
    ``rule`` must be an ART rule the kernel runs (:meth:`ARTConfig.kernel_params`), ``order`` one it walks."""
    if not isinstance(rule, ARTConfig):
        raise TypeError(f"rule must be an ARTConfig (the kernel's rule), got {type(rule).__name__}")
    rule.kernel_params()                                   # a rule the kernel cannot run is refused here
    if order not in KERNEL_ORDERS:
        raise ValueError(f"order must be one the kernel walks, {KERNEL_ORDERS}, got {order!r}")
    trace = blockwise_attention(q, k, v, block_size=block_size, order=order, sm_scale=sm_scale, mode="kernel")
    return kernel_walk_steps(stop(trace, rule), k.shape[1])


def sweep(trace: BlockTrace, rules: Sequence[Rule]) -> SweepResult:
    """Evaluate many rules (a sequence) over one trace (probe statistics are computed once per probe)."""
    if not isinstance(rules, (list, tuple)):
        raise TypeError(f"rules must be a list of rules, got {type(rules).__name__}; for one rule, use stop(trace, "
                        "rule) or sweep(trace, [rule])")
    rules = list(rules)
    if not rules:
        raise ValueError("sweep needs at least one rule")
    evaluator = _Evaluator(trace)
    results = [_result(trace, evaluator.stop_steps(rule)) for rule in rules]
    return SweepResult(rules=rules,
                       stop_step=torch.stack([r.stop_step for r in results]),
                       loaded_fraction=torch.stack([r.loaded_fraction for r in results]),
                       rel_error=torch.stack([r.rel_error for r in results]),
                       cos_error=torch.stack([r.cos_error for r in results]))


class _Evaluator:
    """Caches per-trace quantities shared by many rules."""

    def __init__(self, trace: BlockTrace):
        if not isinstance(trace, BlockTrace):
            raise TypeError(f"expected a BlockTrace, got {type(trace).__name__}")
        self.trace = trace
        steps = trace.partial_out.shape[2]
        self.last_step = trace.steps_per_head - 1                      # [B, Hq]
        self.index = torch.arange(steps, device=trace.partial_out.device)
        self.real = self.index < trace.steps_per_head[..., None]        # [B, Hq, T]
        self._probe_stats: dict = {}
        self._errors = None

    def stop_steps(self, rule: Rule) -> torch.Tensor:
        if isinstance(rule, ARTConfig):
            head_stop = self._art(rule)
            group = rule.group
        elif isinstance(rule, Oracle):
            head_stop = self._oracle(rule.eps)
            group = rule.group
        elif isinstance(rule, MassCoverage):
            head_stop = self._coverage(rule.gamma)
            group = rule.group
        elif isinstance(rule, FixedBudget):
            return torch.minimum(torch.full_like(self.last_step, rule.steps - 1), self.last_step)
        else:
            raise TypeError(f"unknown stopping rule {rule!r}; expected ARTConfig, Oracle, MassCoverage "
                            "or FixedBudget")
        if group == "all":
            size = self.trace.group_size
            grouped = head_stop.view(head_stop.shape[0], -1, size).amax(-1)
            head_stop = grouped.repeat_interleave(size, dim=1)
        return head_stop

    def _first(self, hit: torch.Tensor) -> torch.Tensor:
        """First step where ``hit`` holds among real steps, else the last real step: ``[B, Hq]``."""
        hit = hit & self.real
        first = torch.where(hit, self.index, hit.shape[-1]).amin(-1)
        return torch.where(hit.any(-1), first, self.last_step)

    def _probe(self, rule: ARTConfig):
        dims = rule.probe_dims
        key = (rule.probe_source, dims if isinstance(dims, str) else tuple(dims.tolist()))
        if key not in self._probe_stats:
            x = self.trace.partial_out if rule.probe_source == "output" else self.trace.accumulator
            head_dim = x.shape[-1]
            if isinstance(dims, torch.Tensor):
                if dims.min() < 0 or dims.max() >= head_dim:
                    raise ValueError(f"probe_dims must index head dims in [0, {head_dim})")
                x = x[..., dims.to(x.device)]
            elif dims == "mma":
                x = x[..., mma_probe_dims(head_dim).to(x.device)]
            norm = torch.linalg.vector_norm(x, dim=-1)
            prev_norm = norm[..., :-1]
            change = (norm[..., 1:] - prev_norm).abs()
            direction = one_minus_cos(x[..., 1:, :], x[..., :-1, :], norm[..., 1:], prev_norm)
            relative = change / torch.clamp(prev_norm, min=_TINY)
            self._probe_stats[key] = (change, relative, direction)
        return self._probe_stats[key]

    def _art(self, rule: ARTConfig) -> torch.Tensor:
        change, relative, direction = self._probe(rule)
        stable = torch.ones_like(direction, dtype=torch.bool)
        if rule.use_scale:
            stable &= (relative if rule.scale == "relative" else change) < rule.tau
        if rule.use_direction:
            stable &= direction < rule.phi
        step0 = torch.zeros(*stable.shape[:-1], 1, dtype=torch.bool, device=stable.device)
        stable = torch.cat([step0, stable], dim=-1)  # step 0 never counts
        stable &= (self.index >= rule.min_steps) & self.real
        last_unstable = torch.cummax(torch.where(stable, -1, self.index), dim=-1).values
        run_length = self.index - last_unstable
        return self._first(run_length >= rule.patience)

    def _oracle(self, eps: float) -> torch.Tensor:
        if self._errors is None:
            final = self.trace.final_out[:, :, None, :]
            diff = torch.linalg.vector_norm(self.trace.partial_out - final, dim=-1)
            self._errors = diff / torch.clamp(torch.linalg.vector_norm(final, dim=-1), min=_TINY)
        bad = (self._errors > eps) & self.real
        last_bad = torch.where(bad, self.index, -1).amax(-1)
        return torch.minimum(last_bad + 1, self.last_step)

    def _coverage(self, gamma: float) -> torch.Tensor:
        covered = torch.cumsum(self.trace.block_mass, dim=-1)
        return self._first(covered >= gamma - 1e-12)


def _result(trace: BlockTrace, stop_step: torch.Tensor) -> StopResult:
    index = stop_step[..., None, None].expand(-1, -1, 1, trace.partial_out.shape[-1])
    output = torch.gather(trace.partial_out, 2, index).squeeze(2)
    loaded_fraction = torch.gather(trace.loaded_fraction, -1, stop_step[..., None]).squeeze(-1)
    final = trace.final_out
    final_norm = torch.linalg.vector_norm(final, dim=-1)
    rel_error = torch.linalg.vector_norm(output - final, dim=-1) / torch.clamp(final_norm, min=_TINY)
    cos_error = one_minus_cos(output, final, torch.linalg.vector_norm(output, dim=-1), final_norm)
    return StopResult(stop_step=stop_step, output=output, loaded_fraction=loaded_fraction,
                      rel_error=rel_error, cos_error=cos_error, group_size=trace.group_size)


def one_minus_cos(x: torch.Tensor, y: torch.Tensor, norm_x: torch.Tensor, norm_y: torch.Tensor) -> torch.Tensor:
    """``1 - cos(x, y)`` over the last dim of ``x, y [..., D]`` given their norms ``[...]``, computed as
    ``(|x - y|^2 - (|x| - |y|)^2) / (2 |x| |y|)``.

    The same value as ``1 - x.y / (|x| |y|)``, without its cancellation: near 1 that quotient carries an
    fp32 rounding error of about ``sqrt(D) * 6e-8``, which is the size of the default ``phi = 1e-6``
    itself (on 8k-32k synthetic traces the median relative error of ``1 - cos`` where it is below 1e-5 is
    0.4-1 that way, 2e-5 this way).  Never below 0, as ``1 - cos`` (a rounding below 0 would pass ``phi = 0``);
    1 where ``|x| |y| <= 1e-30`` (a zero vector has no direction).  The kernel's monitor evaluates the same
    expression."""
    moved = ((x - y) ** 2).sum(-1)
    product = norm_x * norm_y
    spread = torch.clamp(moved - (norm_x - norm_y) ** 2, min=0.0)
    return torch.where(product > _TINY, spread / (2 * torch.clamp(product, min=_TINY)), 1.0)
