"""Where the commands write, checked before their work starts: a folder that can be made and written in, or a file
whose folder can, so that a mistyped ``--out`` fails in a second with its reason, not after the run."""
from __future__ import annotations

import os
from pathlib import Path


def check_output_folder(path: Path, option: str) -> Path:
    """Make ``path`` (and its parents) if missing; ``ValueError`` naming ``option`` when it cannot be made or
    written in."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {str(path)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{option} {str(path)!r}: cannot make the folder ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {str(path)!r}: cannot write in the folder (permission denied)")
    return path


def check_output_file(path: Path | None, option: str) -> Path | None:
    """``path`` (``None`` passes) must name a file (not end in ``..``) that is not a folder, and its folder
    must pass :func:`check_output_folder`."""
    if path is None:
        return None
    path = Path(path)
    if path.name in ("", ".."):
        raise ValueError(f"{option} {str(path)!r} names no file; give a file name")
    if path.is_dir():
        raise ValueError(f"{option} {str(path)!r} is a folder; give a file name")
    check_output_folder(path.parent, f"{option} {str(path)!r}: its folder")
    return path
