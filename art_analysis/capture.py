"""Capture post-RoPE KV caches and queries from a real model, and store them on disk.

`capture_kv` runs a causal LM (by default the embedded SmolLM2-135M-Instruct, see
`art_analysis.models`) on a context of `C` tokens (prefill), then decodes `steps` tokens
greedily, one at a time.  It returns a `KVCapture` holding, for every layer:

* ``k, v``: ``[B, Hkv, S, D]`` post-RoPE keys and values read from the model's KV cache
  after the last decode step, with ``S = C + steps`` (the context, then the decode tokens);
* ``decode_q``: ``[B, Hq, steps, D]`` post-RoPE decode queries.  Decode step ``t`` feeds the
  token at position ``C + t`` (the greedy prediction of the previous step), so **its query
  attends to the first ``C + t + 1`` cached tokens** (the context, the ``t`` earlier decode
  tokens, and itself).  `KVCapture.cache_seqlens_for_step(t)` returns that length, and
  `KVCapture.decode_inputs(layer, t)` returns ``(q, k, v, cache_seqlens)`` ready for
  `art_analysis.blockwise.blockwise_attention`;
* ``prefill_q`` (only for the requested ``prefill_layers``): ``[B, Hq, C, D]`` post-RoPE
  queries of the prefill, which attend causally to ``k[:, :, :C]``.

Queries are recorded through transformers' attention interface: the model's configured
attention function (e.g. ``"sdpa"``) is wrapped under a new registered name, with the same
mask function, so the causal mask keeps working and the model computes exactly what it
would without the capture.  Logits are computed for the last position only.

On disk (`KVCapture.save`): one ``layer_NNN.safetensors`` per layer (``k``, ``v``,
``decode_q`` and, if recorded, ``prefill_q``), ``tokens.safetensors`` (``token_ids
[B, S]``: the cached tokens; ``generated_ids [B, steps + 1]``: the greedy output, whose
first ``steps`` entries are the decode tokens) and ``metadata.json`` (model config, text
source and hashes, software versions, dtype, lengths).  A save writes a temporary folder and
renames it, so an interrupted save leaves nothing at the destination.  `KVCapture.load`
reads the metadata and token ids only; each layer is read from disk when asked for.

`KVCapture.select` slices by layers, KV heads (with their query heads) and length, and
`KVCapture.to` converts device and dtype; both are lazy and compose, so
``KVCapture.load(d).select(layers=[15]).to(dtype=torch.float16).save(e)`` reads one layer.
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import numbers
import os
import platform
import shutil
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kernels.int_checks import is_finite_real

from .attention_override import override_attention
from .checks import as_list, check_int, usable_device
from .corpus import Prompt
from .models import LoadedModel, cache_argument, load_model

FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TOKENS_FILE = "tokens.safetensors"
CAPTURE_IMPL_TAG = "art_capture"
CAPTURE_TOKEN_AXES = {"k": 2, "v": 2, "token_ids": 1}   # stored tensors cut to ``kv_length`` along this axis


def layer_filename(layer: int) -> str:
    """File holding one layer's tensors inside a capture folder."""
    return f"layer_{layer:03d}.safetensors"


@dataclass(frozen=True)
class _View:
    """A lazy selection and conversion applied to a capture's stored tensors.

    `kv_positions` index the stored KV heads (query heads follow their group);
    `length` is the number of cached tokens kept.
    """

    layers: tuple[int, ...]
    kv_positions: tuple[int, ...]
    length: int
    device: torch.device | None = None
    dtype: torch.dtype | None = None


def check_capture_destination(directory: str | os.PathLike, overwrite: bool) -> Path:
    """``directory`` as a :class:`Path`, where :meth:`KVCapture.save` may write a capture: a path that does not
    exist yet, or with ``overwrite`` an earlier capture folder or an empty folder.  ``FileExistsError`` for an
    existing path without ``overwrite``, ``ValueError`` for one that ``overwrite`` may not replace (check it before
    a capture's work, as ``art-analysis capture`` does)."""
    dest = Path(directory)
    if dest.exists():
        if not overwrite:
            raise FileExistsError(f"output folder {str(dest)!r} already exists; pass --overwrite "
                                  "(overwrite=True) to replace it")
        if not dest.is_dir() or (any(dest.iterdir()) and not (dest / METADATA_FILE).is_file()):
            raise ValueError(f"refusing to overwrite {str(dest)!r}: it is not a capture folder")
    return dest


class KVCapture:
    """Post-RoPE K, V and queries of a model run, per layer.  See the module docstring.

    Build one with `capture_kv` or `KVCapture.load`; do not call the constructor directly.
    Layers are addressed by their index in the model (`capture.layers` lists those held).
    """

    def __init__(self, metadata: dict, token_ids: torch.Tensor, generated_ids: torch.Tensor,
                 read_layer: Callable[[int], dict[str, torch.Tensor]], view: _View | None = None):
        self._metadata = metadata
        self._token_ids = token_ids
        self._generated_ids = generated_ids
        self._read_layer = read_layer
        self._view = view or _View(
            layers=tuple(metadata["layers"]),
            kv_positions=tuple(range(len(metadata["kv_heads"]))),
            length=metadata["kv_length"],
        )

    # ------------------------------------------------------------------ description
    @property
    def metadata(self) -> dict:
        """The capture's metadata as it would be saved (reflects slicing and dtype)."""
        meta = copy.deepcopy(self._metadata)
        group = self._stored_group_size
        stored_kv = meta["kv_heads"]
        stored_q = meta["query_heads"]
        meta["layers"] = list(self._view.layers)
        meta["prefill_layers"] = [i for i in meta["prefill_layers"] if i in self._view.layers]
        meta["kv_heads"] = [stored_kv[j] for j in self._view.kv_positions]
        meta["query_heads"] = [stored_q[j * group + g] for j in self._view.kv_positions for g in range(group)]
        meta["kv_length"] = self._view.length
        if self._view.dtype is not None:
            meta["dtype"] = str(self._view.dtype).removeprefix("torch.")
        return meta

    @property
    def _stored_group_size(self) -> int:
        return len(self._metadata["query_heads"]) // len(self._metadata["kv_heads"])

    @property
    def layers(self) -> tuple[int, ...]:
        """Model layer indices held by this capture."""
        return self._view.layers

    @property
    def prefill_layers(self) -> tuple[int, ...]:
        """Layers whose prefill queries were recorded."""
        return tuple(i for i in self._metadata["prefill_layers"] if i in self._view.layers)

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """Model KV-head indices held (query heads follow: see `query_heads`)."""
        return tuple(self.metadata["kv_heads"])

    @property
    def query_heads(self) -> tuple[int, ...]:
        """Model query-head indices held, grouped by KV head."""
        return tuple(self.metadata["query_heads"])

    @property
    def batch_size(self) -> int:
        return int(self._token_ids.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self._metadata["model"]["head_dim"])

    @property
    def context_tokens(self) -> int:
        """`C`: tokens of the prefill."""
        return int(self._metadata["context_tokens"])

    @property
    def decode_steps(self) -> int:
        return int(self._metadata["decode_steps"])

    @property
    def kv_length(self) -> int:
        """`S`: cached tokens held per layer (`C + steps` unless sliced shorter)."""
        return self._view.length

    @property
    def sm_scale(self) -> float:
        """The softmax scale the model's attention used."""
        return float(self._metadata["sm_scale"])

    @property
    def token_ids(self) -> torch.Tensor:
        """``[B, S]`` ids of the cached tokens (context, then decode tokens)."""
        return self._token_ids[:, : self._view.length]

    @property
    def generated_ids(self) -> torch.Tensor:
        """``[B, steps + 1]`` greedy output; entry ``t < steps`` is the token fed at decode step ``t``."""
        return self._generated_ids

    @property
    def nbytes(self) -> int:
        """Bytes of all layer tensors of this (sliced, converted) capture."""
        meta = self.metadata
        b, hq, hkv, d = self.batch_size, len(meta["query_heads"]), len(meta["kv_heads"]), self.head_dim
        itemsize = getattr(torch, meta["dtype"]).itemsize
        per_layer = 2 * b * hkv * self.kv_length * d + b * hq * self.decode_steps * d
        prefill = b * hq * min(self.context_tokens, self.kv_length) * d
        return itemsize * (per_layer * len(self.layers) + prefill * len(self.prefill_layers))

    def __repr__(self) -> str:
        return (f"KVCapture(model={self._metadata['model']['name']!r}, layers={len(self.layers)}, "
                f"batch={self.batch_size}, q_heads={len(self.query_heads)}, kv_heads={len(self.kv_heads)}, "
                f"context={self.context_tokens}, steps={self.decode_steps}, kv_length={self.kv_length}, "
                f"dtype={self.metadata['dtype']})")

    # ------------------------------------------------------------------ tensors
    def _tensors(self, layer: int) -> dict[str, torch.Tensor]:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if layer not in self._view.layers:
            raise ValueError(f"layer {layer} is not in this capture; it holds layers {list(self._view.layers)}")
        stored = self._read_layer(layer)
        group = self._stored_group_size
        kv_idx = torch.tensor(self._view.kv_positions, dtype=torch.long)
        q_idx = (kv_idx[:, None] * group + torch.arange(group)).reshape(-1)
        length = self._view.length
        out = {
            "k": stored["k"].index_select(1, kv_idx)[:, :, :length],
            "v": stored["v"].index_select(1, kv_idx)[:, :, :length],
            "decode_q": stored["decode_q"].index_select(1, q_idx),
        }
        if "prefill_q" in stored:
            out["prefill_q"] = stored["prefill_q"].index_select(1, q_idx)[:, :, :length]
        return {name: t.to(device=self._view.device, dtype=self._view.dtype).contiguous() for name, t in out.items()}

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [B, Hq, steps, D], k [B, Hkv, S, D], v [B, Hkv, S, D])`` of one model layer.

        ``q[:, :, t]`` attends to ``k[:, :, :cache_seqlens_for_step(t)]``.
        """
        t = self._tensors(layer)
        return t["decode_q"], t["k"], t["v"]

    def prefill_queries(self, layer: int) -> torch.Tensor:
        """``[B, Hq, N, D]`` prefill queries of a layer (``N = min(C, S)``); query ``i`` attends
        causally to ``k[:, :, :i + 1]``."""
        t = self._tensors(layer)
        if "prefill_q" not in t:
            raise ValueError(f"prefill queries were not recorded for layer {layer}; "
                             f"recorded layers: {list(self.prefill_layers)}")
        return t["prefill_q"]

    def cache_seqlens_for_step(self, step: int) -> torch.Tensor:
        """``[B]`` int32: cached tokens the decode query of `step` attends to, ``C + step + 1``
        (clipped to `kv_length` when the capture was sliced shorter)."""
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < self.decode_steps:
            raise ValueError(f"step must be an int in [0, {self.decode_steps}), got {step!r}")
        seqlen = min(self.context_tokens + step + 1, self.kv_length)
        return torch.full((self.batch_size,), seqlen, dtype=torch.int32, device=self._view.device)

    def decode_inputs(self, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [B, Hq, D], k, v [B, Hkv, S, D], cache_seqlens [B] int32)`` for decode `step`
        of `layer`, as `blockwise_attention` takes them."""
        seqlens = self.cache_seqlens_for_step(step)
        q, k, v = self.layer(layer)
        return q[:, :, step], k, v, seqlens

    def policy_inputs(self, step: int) -> list[tuple]:
        """One tuple per captured layer for decode `step` (negative counts from the end):
        ``(q [B, Hq, D], k, v [B, Hkv, S, D], cache_seqlens [B], queries [B, Hq, step + 1, D], layer,
        num_layers)``, where ``queries`` are the decode queries up to `step` (an observation window
        for query-aware policies), ``layer`` is the model's layer index and ``num_layers`` the
        model's layer count (also for a capture sliced to fewer layers)."""
        if not isinstance(step, int) or isinstance(step, bool) or not -self.decode_steps <= step < self.decode_steps:
            raise ValueError(f"step must be an int in [{-self.decode_steps}, {self.decode_steps}) (negative counts "
                             f"from the end), got {step!r}")
        if step < 0:
            step += self.decode_steps
        num_layers = int(self._metadata["model"]["num_layers"])
        inputs = []
        for layer in self.layers:
            q, k, v, seqlens = self.decode_inputs(layer, step)
            inputs.append((q, k, v, seqlens, self.layer(layer)[0][:, :, : step + 1], layer, num_layers))
        return inputs

    # ------------------------------------------------------------------ views
    def _derive(self, view: _View) -> KVCapture:
        return KVCapture(self._metadata, self._token_ids, self._generated_ids, self._read_layer, view)

    def select(self, *, layers: Sequence[int] | None = None, kv_heads: Sequence[int] | None = None,
               length: int | None = None) -> KVCapture:
        """A lazy slice: model layers `layers`, model KV heads `kv_heads` (their query heads
        come along), and the first `length` cached tokens.

        Slicing the length below ``C + steps`` keeps every decode query but lets it attend only
        to the kept tokens (`cache_seqlens_for_step` is clipped); prefill queries are cut to the
        kept tokens, so they still match the model's causal prefill exactly.
        """
        view = self._view
        if layers is not None:
            layers = _index_list(layers, "layers")
            missing = [i for i in layers if i not in view.layers]
            if missing:
                raise ValueError(f"layers {missing} are not in this capture; it holds {list(view.layers)}")
            view = replace(view, layers=tuple(layers))
        if kv_heads is not None:
            kv_heads = _index_list(kv_heads, "kv_heads")
            held = self.kv_heads
            missing = [h for h in kv_heads if h not in held]
            if missing:
                raise ValueError(f"kv_heads {missing} are not in this capture; it holds {list(held)}")
            view = replace(view, kv_positions=tuple(view.kv_positions[held.index(h)] for h in kv_heads))
        if length is not None:
            if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= view.length:
                raise ValueError(f"length must be an int in [1, {view.length}], got {length!r}")
            view = replace(view, length=length)
        return self._derive(view)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCapture:
        """A lazy copy whose layer tensors come on `device` and in floating `dtype`."""
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        view = self._view
        if device is not None:
            view = replace(view, device=usable_device(device))
        if dtype is not None:
            view = replace(view, dtype=dtype)
        return self._derive(view)

    # ------------------------------------------------------------------ disk
    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the capture to `directory` atomically (temporary folder, then rename).

        Raises `FileExistsError` if `directory` exists and `overwrite` is False; with
        `overwrite`, only an earlier capture folder (or an empty folder) is replaced.
        """
        dest = check_capture_destination(directory, overwrite)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.partial"   # mkdir, unlike mkdtemp, keeps the umask's mode
        tmp.mkdir()
        try:
            for layer in self.layers:
                save_file({n: t.cpu() for n, t in self._tensors(layer).items()}, tmp / layer_filename(layer))
            save_file({"token_ids": self.token_ids.cpu().contiguous(),
                       "generated_ids": self.generated_ids.cpu().contiguous()}, tmp / TOKENS_FILE)
            (tmp / METADATA_FILE).write_text(json.dumps(self.metadata, indent=2, default=str))
            if dest.exists():
                trash = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.old")
                dest.rename(trash)
                tmp.rename(dest)
                shutil.rmtree(trash)
            else:
                tmp.rename(dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    @classmethod
    def load(cls, directory: str | os.PathLike) -> KVCapture:
        """Open a saved capture; layers are read from disk one at a time when asked for."""
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a capture folder's path, got {type(directory).__name__}")
        src = Path(directory)
        meta_path = src / METADATA_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{str(src)!r} is not a capture folder: {METADATA_FILE} is missing")
        try:
            metadata = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{str(meta_path)!r} is not valid JSON ({exc}); "
                             "the capture's metadata is damaged") from exc
        if not isinstance(metadata, dict):
            raise ValueError(f"{str(meta_path)!r} holds a {type(metadata).__name__}, not a capture's metadata object")
        version = metadata.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:          # True == 1, but is no format
            kind = "" if type(version) is int else f" (a {type(version).__name__})"
            raise ValueError(f"{str(src)!r} has capture format {version!r}{kind}; this version reads format "
                             f"{FORMAT_VERSION}, an int")
        if not isinstance(metadata.get("layers"), list):
            raise ValueError(f"{str(meta_path)!r} lists no layers; the capture's metadata is damaged")
        _check_metadata(metadata, meta_path)
        missing = [layer_filename(i) for i in metadata["layers"] if not (src / layer_filename(i)).is_file()]
        if missing or not (src / TOKENS_FILE).is_file():
            raise FileNotFoundError(f"capture {str(src)!r} is incomplete; missing {missing or [TOKENS_FILE]}")
        batch, steps, length = metadata["batch_size"], metadata["decode_steps"], metadata["kv_length"]
        tokens = _read_safetensors(src / TOKENS_FILE, {"token_ids": (batch, length),
                                                       "generated_ids": (batch, steps + 1)}, floating=False)
        hq, hkv, d = len(metadata["query_heads"]), len(metadata["kv_heads"]), metadata["model"]["head_dim"]
        layer_shapes = {"k": (batch, hkv, length, d), "v": (batch, hkv, length, d), "decode_q": (batch, hq, steps, d)}
        # prefill queries are stored cut to the stored length, as k and v
        prefill_shape = {"prefill_q": (batch, hq, min(metadata["context_tokens"], length), d)}
        dtype = getattr(torch, metadata["dtype"])
        return cls(metadata, tokens["token_ids"], tokens["generated_ids"],
                   lambda layer: _read_safetensors(
                       src / layer_filename(layer),
                       {**layer_shapes, **(prefill_shape if layer in metadata["prefill_layers"] else {})}, dtype=dtype))


def _check_metadata(metadata: dict, path: Path) -> None:
    """Raise ``ValueError`` naming ``path`` where a field that reading the capture needs is missing or invalid."""
    def damaged(detail: str) -> ValueError:
        return ValueError(f"{str(path)!r} is damaged: {detail}")

    def is_count(value, minimum: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= minimum

    for key, nonempty in (("layers", True), ("prefill_layers", False), ("kv_heads", True), ("query_heads", True)):
        value = metadata.get(key)
        if not (isinstance(value, list) and (value or not nonempty) and all(is_count(i, 0) for i in value)
                and len(set(value)) == len(value)):
            raise damaged(f"{key} must be a list of distinct ints >= 0{' (at least one)' if nonempty else ''}, "
                          f"got {value!r}")
    if not set(metadata["prefill_layers"]) <= set(metadata["layers"]):
        raise damaged(f"prefill_layers {metadata['prefill_layers']} must be among the layers {metadata['layers']}")
    if len(metadata["query_heads"]) % len(metadata["kv_heads"]):
        raise damaged(f"{len(metadata['query_heads'])} query heads do not split into groups of the "
                      f"{len(metadata['kv_heads'])} KV heads")
    for key, minimum in (("batch_size", 1), ("context_tokens", 1), ("decode_steps", 1), ("kv_length", 1)):
        if not is_count(metadata.get(key), minimum):
            raise damaged(f"{key} must be an int >= {minimum}, got {metadata.get(key)!r}")
    if metadata["kv_length"] > metadata["context_tokens"] + metadata["decode_steps"]:
        raise damaged(f"kv_length {metadata['kv_length']} exceeds context_tokens + decode_steps "
                      f"({metadata['context_tokens']} + {metadata['decode_steps']})")
    model = metadata.get("model")
    if not (isinstance(model, dict) and isinstance(model.get("name"), str) and is_count(model.get("head_dim"), 1)
            and is_count(model.get("num_layers"), 1)):
        raise damaged(f"model must name the model and give its head_dim and num_layers (ints >= 1), got {model!r}")
    if max(metadata["layers"]) >= model["num_layers"]:
        raise damaged(f"layer {max(metadata['layers'])} is past the model's {model['num_layers']} layers")
    dtype = getattr(torch, str(metadata.get("dtype")), None)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise damaged(f"dtype must name a floating torch dtype, got {metadata.get('dtype')!r}")
    scale = metadata.get("sm_scale")
    if not (is_finite_real(scale) and scale > 0):
        raise damaged(f"sm_scale must be a finite number > 0, got {scale!r}")


def _read_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], floating: bool = True,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``shapes`` names in one file of a capture (any other tensor the file holds is not read: a
    ``prefill_q`` of a layer the metadata does not list), each present with that shape (the token axis of ``k``,
    ``v`` and ``token_ids`` at least as long) and of a floating (``floating``) or integer dtype, and ``dtype`` (the
    metadata's) where given, else ``ValueError`` naming the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys() if name in shapes}
    except SafetensorError as exc:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file ({exc}); the capture is damaged") from exc
    for name, shape in shapes.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{str(path)!r} holds no {name!r}; the capture is damaged")
        token_axis = CAPTURE_TOKEN_AXES.get(name)
        got = tuple(t.shape)
        fits = len(got) == len(shape) and all(g == e or (i == token_axis and g >= e)
                                              for i, (g, e) in enumerate(zip(got, shape)))
        if not fits or t.is_floating_point() != floating or dtype not in (None, t.dtype):
            kind = (f"a {str(dtype).removeprefix('torch.')}" if dtype is not None
                    else "a floating" if floating else "an integer")
            raise ValueError(f"{str(path)!r}: {name} is {t.dtype} of shape {got}, expected "
                             f"{kind} tensor of shape {shape}"
                             f"{' (or longer along the tokens)' if token_axis else ''}; the capture is damaged")
    return tensors


def _index_list(values: Sequence[int], name: str) -> list[int]:
    values = as_list(values, name, "[0, 15]")
    if not values or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be a non-empty sequence of ints, got {values!r}")
    values = [int(v) for v in values]
    if len(set(values)) != len(values):
        raise ValueError(f"{name} has duplicates: {values}")
    return values


# ---------------------------------------------------------------------- recording
class _QueryRecorder:
    """An attention hook that records post-RoPE queries, then runs the model's own attention.

    Prefill calls (query length > 1) record ``[B, Hq, C, D]`` for `prefill_layers` and tick
    `on_prefill_layer`; decode calls (query length 1) record ``[B, Hq, 1, D]`` for every layer.
    """

    def __init__(self, prefill_layers: Sequence[int], on_prefill_layer: Callable[[], None]):
        self.prefill_layers = set(prefill_layers)
        self.on_prefill_layer = on_prefill_layer
        self.prefill_q: dict[int, torch.Tensor] = {}
        self.decode_q: dict[int, list[torch.Tensor]] = {}
        self.scaling: set[float] = set()

    def __call__(self, base, module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise TypeError(f"{type(module).__name__} has no layer_idx; capture needs it to tell layers apart")
        if query.shape[2] > 1:
            if layer in self.prefill_layers:
                self.prefill_q[layer] = query.detach().clone()
            self.on_prefill_layer()
        else:
            self.decode_q.setdefault(layer, []).append(query.detach().clone())
        if kwargs.get("scaling") is not None:
            self.scaling.add(float(kwargs["scaling"]))
        return base(module, query, key, value, attention_mask, **kwargs)


# ---------------------------------------------------------------------- inputs
def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_dims(model) -> dict:
    """Layers, heads, head dim and max positions read from a model's config."""
    cfg = _text_config(model)
    num_heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    return {
        "num_layers": int(cfg.num_hidden_layers),
        "num_heads": num_heads,
        "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", 0) or 0),
    }


def _as_list(x) -> list:
    return [x] if isinstance(x, (str, Prompt)) else list(x)


def _input_ids(tokenizer, text, prompt, context_tokens: int | None) -> tuple[torch.Tensor, list[str], list[dict]]:
    """``[B, C]`` input ids, the source texts, and per-row prompt metadata."""
    rows = _as_list(text if text is not None else prompt)
    if not rows:
        raise ValueError("text/prompt is empty")
    if text is not None:
        ids = []
        for i, row in enumerate(rows):
            if not isinstance(row, str):
                raise TypeError(f"text must be a str or a sequence of str, got {type(row).__name__} at row {i}")
            row_ids = tokenizer(row)["input_ids"]
            if len(row_ids) < context_tokens:
                raise ValueError(f"text row {i} has {len(row_ids)} tokens, fewer than context_tokens={context_tokens}")
            ids.append(row_ids[:context_tokens])
        return torch.tensor(ids, dtype=torch.long), rows, [{} for _ in rows]
    ids, texts, metas = [], [], []
    for i, row in enumerate(rows):
        if isinstance(row, Prompt):
            ids.append(list(row.input_ids) if row.input_ids is not None else tokenizer(row.text)["input_ids"])
            texts.append(row.text)
            metas.append(row.metadata())
        elif isinstance(row, str):
            ids.append(tokenizer(row)["input_ids"])
            texts.append(row)
            metas.append({})
        else:
            raise TypeError(f"prompt must be a str, a corpus.Prompt, or a sequence of them; got "
                            f"{type(row).__name__} at row {i}")
    lengths = sorted({len(r) for r in ids})
    if len(lengths) != 1:
        raise ValueError(f"prompts of one capture must have equal token lengths, got {lengths}")
    if context_tokens is not None and lengths[0] != context_tokens:
        raise ValueError(f"prompt has {lengths[0]} tokens but context_tokens={context_tokens}")
    return torch.tensor(ids, dtype=torch.long), texts, metas


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _versions() -> dict:
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__}
    for dist in ("art-analysis", "safetensors", "gguf"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _cached_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


# ---------------------------------------------------------------------- capture
def capture_kv(
    model: str | os.PathLike | LoadedModel = "smollm2",
    *,
    text: str | Sequence[str] | None = None,
    prompt: str | Prompt | Sequence[str | Prompt] | None = None,
    context_tokens: int | None = None,
    decode_steps: int = 8,
    prefill_layers: Sequence[int] = (),
    source: dict | None = None,
    progress: bool = True,
) -> KVCapture:
    """Prefill a context, decode `decode_steps` tokens greedily, and capture K, V and queries.

    Args:
        model: a `MODEL_NAMES` key, a local HF folder or GGUF path, or a `LoadedModel`.
        text: a long text (or one per batch row), cut to its first `context_tokens` tokens.
        prompt: a complete prompt (str or `corpus.Prompt`, or one per row, all of one token
            length) used whole; `context_tokens`, if given, must equal its length.
        context_tokens: `C`, the prefill length; at most the model's max positions.
        decode_steps: greedy decode steps (>= 1) whose queries are recorded.
        prefill_layers: layers whose full prefill queries ``[B, Hq, C, D]`` are also kept.
        source: extra description of the text stored in the metadata (e.g. corpus name, seed).
        progress: show tqdm bars over the prefill (per layer) and the decode (per step).

    Returns:
        a `KVCapture` in memory (the model's dtype, CPU), with ``S = C + decode_steps``.
    """
    decode_steps = check_int(decode_steps, "decode_steps", 1)
    if context_tokens is not None:
        context_tokens = check_int(context_tokens, "context_tokens", 1)
    if (text is None) == (prompt is None):
        raise ValueError("pass exactly one of text= (a long text, cut to context_tokens) or prompt= (used whole)")
    if text is not None and context_tokens is None:
        raise ValueError("text= needs context_tokens= (the prefill length in tokens)")
    prefill_layers = list(prefill_layers)
    loaded = model if isinstance(model, LoadedModel) else load_model(model)
    net, tokenizer = loaded.model, loaded.tokenizer
    dims = model_dims(net)
    max_pos = dims["max_position_embeddings"]
    if context_tokens is not None and max_pos and context_tokens > max_pos:
        raise ValueError(f"context_tokens={context_tokens} exceeds the model's maximum positions "
                         f"(max_position_embeddings={max_pos})")
    prefill_layers = sorted(_index_list(prefill_layers, "prefill_layers")) if prefill_layers else []
    bad = [i for i in prefill_layers if not 0 <= i < dims["num_layers"]]
    if bad:
        raise ValueError(f"prefill_layers {bad} out of range: the model has {dims['num_layers']} layers")

    input_ids, texts, prompt_meta = _input_ids(tokenizer, text, prompt, context_tokens)
    batch, context = input_ids.shape
    if max_pos and context > max_pos:
        raise ValueError(f"the prompt has {context} tokens, more than the model's maximum positions "
                         f"(max_position_embeddings={max_pos})")
    if max_pos and context + decode_steps > max_pos:
        warnings.warn(f"decoding runs to position {context + decode_steps - 1}, past the model's "
                      f"max_position_embeddings={max_pos}", stacklevel=2)

    from transformers import DynamicCache

    prefill_bar = tqdm(total=dims["num_layers"], desc="prefill (layers)", disable=not progress)
    recorder = _QueryRecorder(prefill_layers, lambda: prefill_bar.update(1))
    cache_arg = cache_argument(net)
    cache = DynamicCache()
    generated = []
    try:
        with override_attention(net, recorder, CAPTURE_IMPL_TAG) as base_impl, torch.inference_mode():
            out = net(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
            prefill_bar.close()
            generated.append(out.logits[:, -1].argmax(-1))
            for _ in tqdm(range(decode_steps), desc="decode (steps)", disable=not progress):
                out = net(input_ids=generated[-1][:, None], use_cache=True, logits_to_keep=1, **{cache_arg: cache})
                generated.append(out.logits[:, -1].argmax(-1))
    finally:
        prefill_bar.close()

    kv_length = context + decode_steps
    layers = {}
    for layer in range(dims["num_layers"]):
        k, v = _cached_kv(cache, layer)
        expected = (batch, dims["num_kv_heads"], kv_length, dims["head_dim"])
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"layer {layer} cache holds K {tuple(k.shape)}, V {tuple(v.shape)}; expected "
                             f"{expected} (sliding-window or compressed caches are not supported)")
        tensors = {"k": k, "v": v, "decode_q": torch.cat(recorder.decode_q[layer], dim=2)}
        if layer in recorder.prefill_q:
            tensors["prefill_q"] = recorder.prefill_q[layer]
        layers[layer] = tensors
    if len(recorder.scaling) != 1:
        raise ValueError(f"expected one softmax scale across layers, the model used {sorted(recorder.scaling)}")
    generated_ids = torch.stack(generated, dim=1)
    token_ids = torch.cat([input_ids, generated_ids[:, :decode_steps]], dim=1)

    config = _text_config(net)
    metadata = {
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": loaded.location.name, "path": str(loaded.location.path), **dims,
                  "attn_implementation": base_impl, "config": config.to_dict()},
        "source": {**(source or {}),
                   "text_sha256": [_sha256(t.encode("utf-8")) for t in texts],
                   "input_ids_sha256": _sha256(input_ids.numpy().astype("<i8").tobytes()),
                   "prompts": prompt_meta},
        "versions": _versions(),
        "dtype": str(layers[0]["k"].dtype).removeprefix("torch."),
        "batch_size": batch,
        "context_tokens": context,
        "decode_steps": decode_steps,
        "kv_length": kv_length,
        "sm_scale": recorder.scaling.pop(),
        "layers": list(range(dims["num_layers"])),
        "prefill_layers": prefill_layers,
        "kv_heads": list(range(dims["num_kv_heads"])),
        "query_heads": list(range(dims["num_heads"])),
        "decode_query_attends_to": "decode step t: the first context_tokens + t + 1 cached tokens",
    }
    return KVCapture(metadata, token_ids, generated_ids, layers.__getitem__)
