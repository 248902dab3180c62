"""The softmax-scale argument of every attention entry point (simulator, decode kernel, FlexPrefill reference and
kernels): ``None`` means ``D ** -0.5``; otherwise a finite real number ``> 0``.  Scores are masked with ``-inf`` before
they are scaled, so a scale of zero or below would turn masked scores into NaN or into the maximum."""
from __future__ import annotations

from .int_checks import is_finite_real


def softmax_scale(sm_scale, head_dim: int, name: str = "sm_scale") -> float:
    """``sm_scale`` as a float (``head_dim ** -0.5`` where it is ``None``); ``ValueError`` naming ``name`` unless it is
    a finite real number ``> 0`` (not a ``bool``)."""
    if sm_scale is None:
        return head_dim ** -0.5
    if not (is_finite_real(sm_scale) and sm_scale > 0):
        raise ValueError(f"{name} must be a positive finite number, got {sm_scale!r}")
    return float(sm_scale)
