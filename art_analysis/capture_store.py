"""Captures of the corpus texts, kept on disk by their settings and reused.

``corpus_capture(...)`` returns the capture of ``long_text(text)`` cut to ``context`` tokens,
from ``root/<name>`` when a capture with the same settings is there, else by running the model
(and saving it atomically).  ``reproduce`` and the notebooks share it, so a capture is made once.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .capture import KVCapture, capture_kv
from .corpus import long_text
from .models import LoadedModel, load_model

DEFAULT_ROOT = Path("captures")


def default_root() -> Path:
    """``$ART_CAPTURES`` when set, else ``captures/``."""
    return Path(os.environ.get("ART_CAPTURES", DEFAULT_ROOT))


def corpus_capture(model: str | LoadedModel = "smollm2", *, text: str = "stdlib", context: int = 4096,
                   decode_steps: int = 4, prefill_layers: Sequence[int] = (), seed: int = 0,
                   root: str | os.PathLike | None = None, progress: bool = True) -> tuple[KVCapture, Path]:
    """``(capture, folder)`` of corpus ``text`` (``"stdlib"`` or ``"docs"``) with these settings.

    Args:
        model: a model name / path (loaded only when a capture must be made) or a loaded model.
        prefill_layers: layers whose full prefill queries are recorded (FlexPrefill).
        root: the folder holding the captures (default :func:`default_root`).
    """
    root = Path(root) if root is not None else default_root()
    name = Path(str(model.location.name if isinstance(model, LoadedModel) else model)).stem
    layers = "-p" + "_".join(str(i) for i in sorted(prefill_layers)) if prefill_layers else ""
    folder = root / f"{name}-{text}-s{seed}-c{context}-d{decode_steps}{layers}"
    if folder.exists():
        return KVCapture.load(folder), folder
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    # About 3-4 characters a token for source code and prose; ask for comfortably more text.
    capture = capture_kv(loaded, text=long_text(text, seed=seed, length=8 * context), context_tokens=context,
                         decode_steps=decode_steps, prefill_layers=prefill_layers,
                         source=dict(corpus=text, seed=seed), progress=progress)
    capture.save(folder)
    return capture, folder
