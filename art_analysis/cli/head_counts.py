"""Parsing the ``--heads Q/KV`` option of the commands that build synthetic inputs."""
from __future__ import annotations


def parse_head_counts(text: str) -> tuple[int, int]:
    """``"32/8"`` -> ``(32, 8)`` query and KV heads; a clear ``ValueError`` otherwise."""
    try:
        q_heads, kv_heads = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--heads must look like 32/8 (query/KV heads), got {text!r}") from None
    return q_heads, kv_heads
