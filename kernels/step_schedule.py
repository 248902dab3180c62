"""The instruction schedule of a compiled kernel, read from its SASS (Hopper, sm_90): its MMA loops, and the round
trips to memory of its straight-line loads.

A monitored walk alone on its multiprocessor is latency-bound: one step is a chain of dependent instructions (the
``q K^T`` MMAs, the softmax, the ``P V`` MMAs, the monitor), so its time follows the cycles the step's loop stalls
between issues, which ptxas encodes in each instruction's control bits.  The ``q K^T`` product of one step is
``D / 16`` MMAs accumulating into each score tile; ptxas may interleave the tiles' chains, or issue each chain
whole, every MMA then waiting the previous one's latency (a *serialised* chain).  Which it does depends on code
around the loop, not on the loop's own source: on the H200 (Triton 3.6) the 128-dim on-demand leader's step was
serialised (1721 stall cycles per step against 1313 for the single walk) and walked 1.48 us per block against
1.19 (``benchmarks/NOTES-art-decode.md``, V54), until the leader's horizon was carried from one chunk to the next
(V57: 1370 stall cycles).  :func:`mma_loop_schedules` reads the loops; the GPU tests check that the default plan's
builds and the on-demand plan's keep their chains interleaved.

A kernel without a loop that waits on memory (the wave's, ``kernels.art_wave_kernel``) takes as many memory
latencies as its loads take round trips: a warp issues in order, so an instruction that reads a loaded register
waits for that load, and every load after it starts a new round trip.  :func:`load_round_trips` counts them.

Control bits (Volta and newer, the high 64-bit word of each 128-bit instruction): stall cycles in bits 41-44.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

SERIALISED_MMA_STALL = 12   # an MMA issued this many cycles after its predecessor waited on its result
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);\s*/\* (0x[0-9a-f]{16}) \*/")
_CONTROL = re.compile(r"/\* (0x[0-9a-f]{16}) \*/")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_x_\d+)\)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
_LOAD_WIDTH = {"64": 2, "128": 4}        # registers an LDG.E.64 / .128 writes


@dataclasses.dataclass(frozen=True)
class LoopSchedule:
    """One innermost loop of a kernel that holds MMAs: its first instruction's address, instructions per
    iteration, the sum of their issue stalls (cycles, a lower bound on one iteration of one warp), its MMAs, and
    the MMAs issued at least ``SERIALISED_MMA_STALL`` cycles after the instruction before them."""

    start: int
    instructions: int
    stall_cycles: int
    mmas: int
    serialised_mmas: int


def sass_with_control(cubin: bytes) -> list[tuple[int, str, int, str | None]]:
    """``(address, text, stall cycles, label)`` of each instruction of ``cubin`` (``label``: the branch-target
    label that precedes it, if any), from ``nvdisasm -hex`` of the Triton wheel's CUDA tools."""
    import triton

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-hex", path], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
    instructions, label = [], None
    for i, line in enumerate(listing):
        target = _LABEL.match(line.strip())
        if target:
            label = target.group(1)
            continue
        found = _INSTRUCTION.match(line)
        if found:
            control = int(_CONTROL.search(listing[i + 1]).group(1), 16)
            instructions.append((int(found.group(1), 16), found.group(2).strip(), (control >> 41) & 0xF, label))
            label = None
    return instructions


def mma_loop_schedules(cubin: bytes) -> list[LoopSchedule]:
    """The innermost loops (a backward branch's range that holds no other) of ``cubin`` that hold MMAs, in address
    order."""
    instructions = sass_with_control(cubin)
    label_address = {label: address for address, _, _, label in instructions if label}
    ranges = sorted({(label_address[branch.group(1)], address) for address, text, _, _ in instructions
                     if (branch := _BRANCH.search(text)) and label_address.get(branch.group(1), address) < address})
    innermost = [(lo, hi) for lo, hi in ranges
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in ranges)]
    schedules = []
    for lo, hi in innermost:
        body = [(text, stall) for address, text, stall, _ in instructions if lo <= address <= hi]
        mma_stalls = [stall for text, stall in body if "HMMA" in text]
        if mma_stalls:
            schedules.append(LoopSchedule(start=lo, instructions=len(body), stall_cycles=sum(s for _, s in body),
                                          mmas=len(mma_stalls),
                                          serialised_mmas=sum(s >= SERIALISED_MMA_STALL for s in mma_stalls)))
    return schedules


def _registers(operands: str) -> set[int]:
    """The general registers an operand list names (a ``.64`` pair counts both)."""
    named = set()
    for found in _REGISTER.finditer(operands):
        first = int(found.group(1))
        named |= {first, first + 1} if found.group(2) else {first}
    return named


def round_trips(instructions: list[str]) -> list[int]:
    """The global loads into registers (``LDG``) of straight-line SASS ``instructions`` (texts, in issue order), per
    round trip to memory: a new round trip starts at the first load after an instruction that reads a register an
    earlier load of the current round trip writes (or a load whose address does).  Branches are read as
    straight-line code, so a loop's loads count once; TMA copies (``UTMALDG``) and copies to shared memory
    (``LDGSTS``) are not counted."""
    trips, pending = [], set()
    for text in instructions:
        body = _PREDICATE.sub("", text.strip())
        opcode, _, operands = body.partition(" ")
        first, _, rest = operands.partition(",")
        is_load = opcode.split(".")[0] == "LDG"       # not LDGSTS (to shared memory) or LDGDEPBAR
        writes_first = not opcode.startswith(("ST", "RED", "ATOM", "BAR", "BRA", "EXIT")) and _REGISTER.fullmatch(
            first.strip().removesuffix(".reuse")) is not None
        reads = _registers(rest) if writes_first else _registers(operands)
        if reads & pending:
            pending = set()
        if is_load:
            if not pending:
                trips.append(0)
            trips[-1] += 1
            destination = int(_REGISTER.match(first.strip()).group(1))
            pending |= set(range(destination, destination + _LOAD_WIDTH.get(opcode.rsplit(".", 1)[-1], 1)))
    return trips


def load_round_trips(cubin: bytes) -> list[int]:
    """:func:`round_trips` of ``cubin``'s instructions in address order."""
    return round_trips([text for _, text, _, _ in sass_with_control(cubin)])
