"""Runtime parameters of the ART monitor inside the decode kernel.

`ARTParams` mirrors `art_analysis.termination.ARTConfig` restricted to what a kernel
program can evaluate (`ARTConfig.kernel_params()` converts).  Every threshold is passed
to the kernel as a runtime scalar, never as a `tl.constexpr`, so sweeping thresholds
never recompiles, except that whether `phi` lies in `(0, 1]` picks one of two builds of the
direction test (outside it, the guards of a zero probe and of `phi = 0` are compiled in:
`kernels.art_decode._direction_build`).  The monitor semantics (identical to the simulator's
`mode="kernel"` replay evaluated by `art_analysis.termination.stop`) are:

* after step `t` the probe `x^(t)` is the running output `acc / l` (`probe_source="output"`)
  or the un-normalised accumulator `acc` (`"accumulator"`), restricted to the probe dims
  (`"full"`: all `D`; `"mma"`: dims with `d % 8 in {0, 1}`);
* `d_scale = | ||x^(t)|| - ||x^(t-1)|| |`, divided by `max(||x^(t-1)||, 1e-30)` when
  `scale="relative"`; `d_dir = 1 - <x^(t), x^(t-1)> / max(||x^(t)|| ||x^(t-1)||, 1e-30)`;
* step `t >= max(1, min_steps)` is stable when `(not use_scale or d_scale < tau)` and
  `(not use_direction or d_dir < phi)`; a per-head counter rises on a stable step and
  resets to 0 on an unstable one; a head is *done* (latched) once its counter reaches
  `patience`;
* a program (one `(b, kv_head)`, all query heads of the group) stops after the first step
  at which every head of the group is done (`group="all"`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .int_checks import check_count, is_finite_real

PROBE_SOURCES = ("output", "accumulator")
PROBE_DIMS = ("full", "mma")
SCALES = ("relative", "absolute")
INT32_MAX = 2 ** 31 - 1    # patience and min_steps reach the kernel as int32 scalars


def check_threshold(value, name: str) -> float:
    """A threshold (``tau``, ``phi``, an oracle's ``eps``): a finite real number ``>= 0`` (NumPy scalars included, a
    ``bool`` not); returned as a ``float``, else ``ValueError`` naming it."""
    if not (is_finite_real(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_switches(holder, names: tuple[str, ...]) -> None:
    """The ablation switches ``names`` of ``holder`` must be ``bool`` (a string such as ``"no"`` would read as
    true), and at least one of them true."""
    for name in names:
        if not isinstance(getattr(holder, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(holder, name)!r}")
    if not any(getattr(holder, name) for name in names):
        raise ValueError(f"at least one of {' and '.join(names)} must be True")


@dataclass(frozen=True)
class ARTParams:
    """Monitor settings for `art_decode` (see the module docstring for the exact rule)."""

    tau: float = 1e-2
    phi: float = 1e-6
    patience: int = 16
    min_steps: int = 1
    probe_source: str = "output"
    probe_dims: str = "full"
    scale: str = "relative"
    use_scale: bool = True
    use_direction: bool = True

    def __post_init__(self) -> None:
        for name in ("tau", "phi"):
            object.__setattr__(self, name, check_threshold(getattr(self, name), name))
        check_count(self.patience, "patience", 1, INT32_MAX, unit="steps")
        check_count(self.min_steps, "min_steps", 0, INT32_MAX, unit="steps")
        if self.probe_source not in PROBE_SOURCES:
            raise ValueError(f"probe_source must be one of {PROBE_SOURCES}, got {self.probe_source!r}")
        if self.probe_dims not in PROBE_DIMS:
            raise ValueError(f"probe_dims must be one of {PROBE_DIMS} in the kernel, got {self.probe_dims!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        check_switches(self, ("use_scale", "use_direction"))
