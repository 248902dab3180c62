"""Result files: writing them atomically (a temporary file in the same folder, then a rename), naming the inputs
they were measured on, and finding the newest result of a benchmark suite."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, payload, indent: int = 2) -> Path:
    """``payload`` as JSON (trailing newline) through :func:`write_text_atomic`."""
    return write_text_atomic(path, json.dumps(payload, indent=indent) + "\n")


def input_file_record(path: str | os.PathLike) -> dict:
    """``{"name", "bytes", "sha256"}`` of an input file (a captured layer), so that a result names the data it was
    measured on whatever the file was called where it ran."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


RESULTS_DIR = Path("benchmarks/results")


def latest_result(suite: str, folder: str | os.PathLike = RESULTS_DIR) -> Path | None:
    """The newest ``<date>-<suite>.json`` in ``folder`` (by name, which starts with the date), or None.

    ``suite`` is e.g. ``"art-decode"`` or ``"flexprefill"``; suffixed copies such as
    ``<date>-<suite>-v2.json`` are earlier runs kept for the record and are not matched.
    """
    found = sorted(Path(folder).glob(f"*-{suite}.json"))
    return found[-1] if found else None
