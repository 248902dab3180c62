"""Pack a captured layer (a capture folder's ``layer_NNN.safetensors``) small enough to send to a GPU machine, and
unpack it there.

    python scripts/pack_capture_layer.py pack captures/NAME/layer_015.safetensors layer15.xz
    python scripts/pack_capture_layer.py unpack layer15.xz /tmp/layer_015.safetensors

A layer of 8 sequences of 8192 tokens in float16 takes about 50 MB, which xz alone barely shrinks: the low byte of
each element is nearly random.  Stored as byte planes (every tensor's high bytes, then its low bytes), the high
bytes compress better: SmolLM2's layer 15 of `art-analysis capture --seed 1 --batch 8 --context 8192
--decode-steps 8 --dtype float16` packs from 48.1 MiB to 40.2 MiB (84 %), within the 64 MiB a device call
carries.  The unpacked file holds the same tensors bit for bit (``unpack`` checks each tensor's SHA-256 against
the one recorded at packing).  Both write a partial file and rename it, so an interrupted run leaves no damaged
layer.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MAGIC = b"ARTPLANES1"


def _planes(tensor: torch.Tensor) -> bytes:
    raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1, tensor.element_size())
    return b"".join(np.ascontiguousarray(raw[:, i]).tobytes() for i in range(raw.shape[1] - 1, -1, -1))


def _from_planes(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    planes = np.frombuffer(data, dtype=np.uint8).reshape(size, -1)[::-1]
    raw = np.ascontiguousarray(planes.T).reshape(-1)
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def pack(source: Path, dest: Path) -> None:
    tensors = load_file(str(source))
    header = {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "sha256": _digest(t)}
              for name, t in tensors.items()}
    body = json.dumps(header).encode()

    def write(partial: Path) -> None:
        with lzma.open(partial, "wb", preset=9) as f:
            f.write(MAGIC + struct.pack("<Q", len(body)) + body)
            for name in header:
                f.write(_planes(tensors[name]))

    _write_then_rename(dest, write)
    print(f"{source} ({source.stat().st_size / 2 ** 20:.1f} MiB) -> {dest} ({dest.stat().st_size / 2 ** 20:.1f} MiB)")


def unpack(source: Path, dest: Path) -> None:
    with lzma.open(source, "rb") as f:
        try:
            magic = f.read(len(MAGIC))
        except lzma.LZMAError:
            magic = b""
        if magic != MAGIC:
            raise ValueError(f"{source} is not a layer packed by this script")
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        tensors = {}
        for name, info in header.items():
            dtype = getattr(torch, info["dtype"])
            count = int(np.prod(info["shape"])) * torch.empty((), dtype=dtype).element_size()
            tensors[name] = _from_planes(f.read(count), dtype, info["shape"])
            if _digest(tensors[name]) != info["sha256"]:
                raise ValueError(f"{source}: tensor {name!r} does not unpack to the tensor packed")
    _write_then_rename(dest, lambda partial: save_file(tensors, str(partial)))
    print(f"{source} -> {dest}: {', '.join(f'{n} {list(t.shape)} {t.dtype}' for n, t in tensors.items())}")


def _write_then_rename(dest: Path, write) -> None:
    """``write(partial)`` a file beside ``dest``, then rename it to ``dest``; a failure or an interruption removes the
    partial file and leaves ``dest`` as it was."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial")
    try:
        write(partial)
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{args.source} is not a file")
    if args.dest.is_dir():
        parser.error(f"{args.dest} is a folder: name the file to write")
    try:
        (pack if args.action == "pack" else unpack)(args.source, args.dest)
    except (ValueError, EOFError, lzma.LZMAError, SafetensorError) as exc:
        print(f"pack_capture_layer.py {args.action}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
