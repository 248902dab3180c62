"""KV-selection policies that compose with ART (DESIGN §6).

A policy keeps KV blocks per ``(b, kv_head)``; the simulator takes its selection as
``selection=`` and ART then walks only the kept blocks (see :mod:`.compose`).  Build one by
name::

    from art_analysis import policies
    policy = policies.make("snapkv", budget=0.2)             # or
    policy = policies.parse_spec("snapkv:budget=0.2,window=32")
    keep = policy.select(k, v, queries=q[:, :, None], block_size=64)   # BoolTensor [B, Hkv, nb]

Budgets, and how they map to blocks, are defined in :mod:`.budget`.  A new method is a frozen dataclass
subclassing :class:`SelectionPolicy` (or :class:`BudgetPolicy`, which checks a ``budget`` field and counts the
blocks it keeps) with a ``name`` and ``keep_blocks``; add it to ``REGISTRY`` to build it by name.
"""
from __future__ import annotations

from dataclasses import MISSING, fields

from .base import BudgetPolicy, SelectionInputs, SelectionPolicy
from .coverage import CoveragePolicy
from .dense import DensePolicy
from .h2o import H2OPolicy
from .oracle_contribution import OracleContributionPolicy
from .pyramidkv import PyramidKVPolicy
from .quest import QuestPolicy
from .snapkv import SnapKVPolicy
from .streaming import StreamingPolicy

REGISTRY: dict[str, type[SelectionPolicy]] = {
    cls.name: cls for cls in (DensePolicy, StreamingPolicy, SnapKVPolicy, PyramidKVPolicy, H2OPolicy,
                              QuestPolicy, CoveragePolicy, OracleContributionPolicy)
}

__all__ = ["REGISTRY", "make", "parse_spec", "SelectionPolicy", "BudgetPolicy", "SelectionInputs", *(
    cls.__name__ for cls in REGISTRY.values())]


def make(name: str, **params) -> SelectionPolicy:
    """Build the policy registered as ``name`` with hyper-parameters ``params``.

    Raises:
        ValueError: unknown name, unknown or missing parameter (the message lists the valid ones).
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(REGISTRY)}")
    cls = REGISTRY[name]
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for policy {name!r}; "
                         f"valid parameters: {', '.join(allowed) or '(none)'}")
    missing = [n for n, f in allowed.items() if f.default is MISSING and n not in params]
    if missing:
        raise ValueError(f"policy {name!r} needs {', '.join(missing)} (valid parameters: {', '.join(allowed)})")
    return cls(**params)


def parse_spec(spec: str) -> SelectionPolicy:
    """Build a policy from ``"name"`` or ``"name:key=value,key=value"`` (e.g. ``"snapkv:budget=0.2"``).

    Values are read as ``None``, ``true``/``false``, an int, a float or else a string; so
    ``budget=256`` is a budget in tokens and ``budget=0.2`` a fraction.  ``policy.spec`` gives a
    string this reads back.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy spec is 'name' or 'name:key=value,...', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    params: dict = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        if key in params:
            raise ValueError(f"policy spec {spec!r}: parameter {key!r} given twice")
        params[key] = _parse_value(text.strip())
    return make(name.strip(), **params)


def _parse_value(text: str):
    lowered = text.lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
