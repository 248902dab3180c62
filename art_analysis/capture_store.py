"""Captures of the corpus texts, kept on disk by their settings and reused.

``corpus_capture(...)`` returns the capture of ``long_text(text)`` cut to ``context`` tokens,
from ``root/<name>`` when a capture with the same settings is there, else by running the model
(and saving it atomically).  ``reproduce`` and the notebooks share it, so a capture is made once.

``<name>`` holds the settings but only the stem of the model's name, so a folder found there is checked against
the request (the model, as the capture records it, the text, seed, context, decode steps and prefill layers);
one that differs is an error naming the folder and the fields, never replaced: it may be the only copy of
another model's capture.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from .capture import KVCapture, capture_kv
from .corpus import long_text
from .models import MODEL_NAMES, LoadedModel, load_model, locate_model

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

    Raises:
        ValueError: the folder for these settings holds a capture of other settings (see the module docstring).
    """
    root = Path(root) if root is not None else default_root()
    name = Path(str(model.location.name if isinstance(model, LoadedModel) else model)).stem
    layers = "-p" + "_".join(str(i) for i in sorted(prefill_layers)) if prefill_layers else ""
    folder = root / f"{name}-{text}-s{seed}-c{context}-d{decode_steps}{layers}"
    if folder.exists():
        capture = KVCapture.load(folder)
        metadata = capture.metadata
        source = metadata.get("source") or {}
        requested = dict(corpus=text, seed=seed, context_tokens=context, decode_steps=decode_steps,
                         prefill_layers=sorted(prefill_layers))
        recorded = dict(corpus=source.get("corpus"), seed=source.get("seed"), context_tokens=capture.context_tokens,
                        decode_steps=capture.decode_steps, prefill_layers=list(capture.prefill_layers))
        differences = _model_differences(model, metadata["model"]) + [
            f"{key} {recorded[key]!r} (requested {requested[key]!r})" for key in requested
            if recorded[key] != requested[key]]
        if differences:
            raise ValueError(f"capture folder {str(folder)!r} does not match the request: it holds "
                             f"{', '.join(differences)}; remove it or pass another root")
        return capture, folder
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    # About 3-4 characters a token for source code and prose; ask for comfortably more text.
    capture = capture_kv(loaded, text=long_text(text, seed=seed, length=8 * context), context_tokens=context,
                         decode_steps=decode_steps, prefill_layers=prefill_layers,
                         source=dict(corpus=text, seed=seed), progress=progress)
    capture.save(folder)
    return capture, folder


def _model_differences(model: str | os.PathLike | LoadedModel, recorded: dict) -> list[str]:
    """How the model a capture records (its metadata's ``model``) differs from the requested ``model``: one line,
    or none where they are the same model.

    An embedded model (a `MODEL_NAMES` key) is identified by its name, which is all a capture of it needs to
    match (the model need not be installed); any other model by its file or folder, resolved.
    """
    location = model.location if isinstance(model, LoadedModel) else None
    name = location.name if location is not None else str(model)
    if name in MODEL_NAMES:
        return [] if recorded.get("name") == name else [f"model {recorded.get('name')!r} (requested {name!r})"]
    path = (location or locate_model(model)).path.resolve()
    if recorded.get("path") is not None and Path(recorded["path"]).resolve() == path:
        return []
    return [f"model {recorded.get('name')!r} at {recorded.get('path')!r} (requested {str(path)!r})"]
