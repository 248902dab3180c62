"""Result files: writing them atomically (a temporary file in the same folder, then a rename), naming the inputs
and the code they were measured with, finding the newest result of a benchmark suite, and reading its summary."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE_COMMIT_ENV = "ART_SOURCE_COMMIT"   # names the commit of a tree copied without its history


def new_file_mode() -> int:
    """The mode a plain ``open`` gives a new file: ``0o666`` less the process's umask (a temporary file is made
    ``0o600`` and takes this before it is renamed into place)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, payload, indent: int = 2) -> Path:
    """``payload`` as standard JSON (trailing newline) through :func:`write_text_atomic`.  A float that is not
    finite (an undefined mean, such as a share over no truncated heads) is written as ``null``: JSON has no NaN or
    Infinity, and strict readers refuse the bare tokens."""
    return write_text_atomic(path, json.dumps(_finite_or_null(payload), indent=indent, allow_nan=False) + "\n")


def _finite_or_null(value):
    """``value`` with every non-finite float, at any depth of dicts, lists and tuples, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def input_file_record(path: str | os.PathLike) -> dict:
    """``{"name", "bytes", "sha256"}`` of an input file (a captured layer), so that a result names the data it was
    measured on whatever the file was called where it ran."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def source_revision(root: str | os.PathLike | None = None) -> dict:
    """The code a result is measured with, ``{"commit", "modified", "from"}``: the commit named by the environment
    variable ``ART_SOURCE_COMMIT`` where it is set (a tree copied to a GPU machine, whose own git history, if the
    copy has one, need not be the tree's; ``modified`` unknown: ``None``); else, where ``root`` (default: this
    package's folder) lies in a git checkout, its ``HEAD`` and whether tracked files differ from it (``from`` =
    ``"git"``); else ``None`` for both."""
    named = os.environ.get(SOURCE_COMMIT_ENV) or None
    if named:
        return {"commit": named, "modified": None, "from": SOURCE_COMMIT_ENV}
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        commit = _git(root, "rev-parse", "HEAD")
        modified = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
        return {"commit": commit, "modified": modified, "from": "git"}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None, "from": None}


def _git(root: Path, *args: str) -> str:
    """The output of ``git -C root ARGS`` (``CalledProcessError`` outside a checkout)."""
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


RESULTS_DIR = Path("benchmarks/results")


def latest_result(suite: str, folder: str | os.PathLike = RESULTS_DIR) -> Path | None:
    """The newest ``<date>-<suite>.json`` in ``folder`` (by name, which starts with the date), or None.

    ``suite`` is e.g. ``"art-decode"`` or ``"flexprefill"``; suffixed copies such as
    ``<date>-<suite>-v2.json`` are earlier runs kept for the record and are not matched.
    """
    found = sorted(Path(folder).glob(f"*-{suite}.json"))
    return found[-1] if found else None


def read_result(path: str | os.PathLike, required: tuple[str, ...] = (), what: str = "result") -> dict:
    """The JSON object stored at ``path`` (a benchmark result or a stored analysis), holding the keys ``required``;
    ``FileNotFoundError`` or ``ValueError`` naming the file otherwise.  ``what`` names the file in the errors.  A
    ``rows`` entry, required or not, must be a list of objects."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is not a file")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not JSON text (not UTF-8: {exc.reason} at byte {exc.start})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{what} {path} holds a {type(payload).__name__}, not a JSON object")
    missing = [key for key in required if key not in payload]
    if missing:
        raise ValueError(f"{what} {path} lacks {', '.join(missing)}")
    rows = payload.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{what} {path}: rows must be a list of objects")
    return payload


def flat_summary(payload: dict) -> dict:
    """A benchmark result's ``summary`` as one level of entries: a decode-loop result's, which holds one summary per
    loop (``"<batch>x<seqlen>"``), as ``"<batch>x<seqlen> <entry>"`` with the per-implementation totals (dicts) left
    out; any other's as it is (``{}`` where the result has none)."""
    summary = payload.get("summary") or {}
    if payload.get("suite") == "decode-loop":
        return {f"{loop} {key}": value for loop, numbers in summary.items()
                for key, value in numbers.items() if not isinstance(value, dict)}
    return dict(summary)
