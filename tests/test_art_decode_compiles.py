"""The ART decode kernel compiles for Hopper (sm_90) in every configuration the launcher produces, and the default
plan's builds schedule the monitored step's MMAs interleaved.

The CPU interpreter runs the kernels' Python directly, so it cannot see what only Triton's compiler
frontend rejects, such as a reshape in a branch that a constant condition skips but an early return
does not.  These tests record the launches of ``art_decode`` (without running them) and compile each
one for sm_90 in a subprocess without the interpreter; no GPU is needed, except to check the schedule
that the GPU machine's own Triton gives (``kernels.step_schedule``).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from art_analysis.termination import ARTConfig
from kernels.art_decode import ON_DEMAND_POLL_NS, art_decode
from kernels import art_wave_kernel
from kernels.art_decode_kernel import UNSPECIALISED_INTS, art_decode_split_kernel
from kernels.art_wave_kernel import WAVE_UNSPECIALISED_INTS
from kernels.pair_walks import PairWalks

ROOT = Path(__file__).resolve().parents[1]
TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
              torch.int64: "i64"}
COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.art_decode_kernel, kernels.art_wave_kernel
for launch in json.load(sys.stdin):
    kernel = getattr(getattr(kernels, launch.get("module", "art_decode_kernel")),
                     launch.get("kernel", "art_decode_split_kernel"))
    attrs = {(index,): [["tt.divisibility", 16]] for index in launch["divisible_by_16"]}
    source = ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"], attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    if launch.get("cubin"):
        with open(launch["cubin"], "wb") as f:
            f.write(compiled.asm["cubin"])
    print(launch["label"], "SASS bytes", len(compiled.asm["cubin"]), "nanosleep" in compiled.asm["ptx"], flush=True)
"""


def _argument_type(value) -> str:
    """Triton's signature type of one recorded launch argument."""
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_NAMES[value.dtype]
    if type(value).__name__ == "TensorDescriptor":
        return f"tensordesc<{TYPE_NAMES[value.base.dtype]}{list(value.block_shape)}>".replace(" ", "")
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, int) and not isinstance(value, bool):
        return "i32"
    raise TypeError(f"unexpected launch argument {value!r}")


def _divisible_by_16(value) -> bool:
    """Whether Triton's JIT compiles a launch argument as divisible by 16: a tensor whose address is, or an int."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _compile_request(label: str, arg_names, call, unspecialised=UNSPECIALISED_INTS) -> dict:
    """What the subprocess compiles for one recorded launch (``conftest.KernelLaunches``' call), specialised as the
    JIT specialises a launch on the GPU: an int argument equal to 1 becomes a constant, and the arguments divisible
    by 16 are compiled as such (without that, pointer loads compile to scalar loads with a register each, and a
    128-token build to 255 registers and 40 KB of shared memory instead of 151 and 136 KB), except the kernel's
    ``UNSPECIALISED_INTS`` (``unspecialised``: the launched kernel's), which stay plain values."""
    options = {name: call.kwargs[name] for name in ("num_warps", "num_stages")}
    constexprs = {name: value for name, value in call.kwargs.items() if name not in options}
    if constexprs.get("ON_DEMAND"):   # recorded on the CPU, which polls without sleeping: compile the GPU's sleep
        constexprs["POLL_NS"] = ON_DEMAND_POLL_NS
    signature, divisible = {}, []
    for index, (name, value) in enumerate(zip(arg_names, call.args)):
        specialised = name not in unspecialised
        if specialised and isinstance(value, int) and not isinstance(value, bool) and value == 1:
            constexprs[name] = 1
        else:
            signature[name] = _argument_type(value)
            divisible += [index] if specialised and _divisible_by_16(value) else []
    signature.update({name: "constexpr" for name in constexprs})
    return {"label": label, "signature": signature, "constexprs": constexprs, "options": options,
            "divisible_by_16": divisible}


# (label, q_heads, kv_heads, head_dim, dtype, art, call keywords): the monitor's row selection (groups of at most
# 8 read half the tile, larger ones all of it), both orders, one split and the leader scheme, ragged and uniform
# lengths (descriptors made in the kernel or on the host), deferred and on-demand followers, per-pair splits, the
# paged layout (one tile per page of 16 tokens, one per block within a page, pointer loads on pages of 8), the dense
# walk, fp32 and the smaller blocks; and the builds that record the splits each output kept (result steps).
CASES = [
    ("group 4, one split, uniform", 32, 8, 128, torch.bfloat16, True, dict(num_splits=1)),
    ("group 12, one split, uniform", 24, 2, 128, torch.bfloat16, True, dict(num_splits=1)),
    ("group 32, leader scheme, ragged", 64, 2, 128, torch.float16, True, dict(num_splits=3, ragged=True)),
    ("group 3, leader scheme, sequential, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(num_splits=4, ragged=True, order="sequential")),
    ("group 16, paged", 32, 2, 64, torch.float16, True, dict(num_splits=2, paged=True)),
    ("group 4, pages of 8, D 128", 32, 8, 128, torch.bfloat16, True, dict(num_splits=1, paged=True, page_size=8)),
    ("dense, block 128", 32, 8, 128, torch.bfloat16, False, dict(num_splits=5)),
    ("group 1, fp32, block 32", 4, 4, 64, torch.float32, True, dict(num_splits=1, block_size=32)),
    ("group 8, paged, block 16, D 128", 16, 2, 128, torch.bfloat16, True,
     dict(num_splits=1, paged=True, block_size=16)),
    ("group 5, dense, block 64, ragged", 10, 2, 64, torch.float16, False,
     dict(num_splits=3, ragged=True, block_size=64)),
    ("group 4, deferred followers, uniform", 32, 8, 128, torch.bfloat16, True, dict(num_splits=4, follow_step=34)),
    ("group 3, deferred followers, ragged, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(num_splits=5, follow_step=20, ragged=True)),
    ("group 4, per-pair splits, uniform", 32, 8, 128, torch.bfloat16, True, dict(lopsided_walks=True)),
    ("group 3, per-pair splits, ragged, D 64", 9, 3, 64, torch.bfloat16, True, dict(lopsided_walks=True, ragged=True)),
    ("group 3, on-demand followers, uniform, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(num_splits=8, follow_step=34, release_walks=132)),
    ("group 4, on-demand followers, ragged", 32, 8, 128, torch.bfloat16, True,
     dict(num_splits=4, release_walks=66, ragged=True)),
    ("group 3, one split, result steps, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(num_splits=1, return_result_steps=True)),
    ("group 4, deferred followers, result steps", 32, 8, 128, torch.bfloat16, True,
     dict(num_splits=4, follow_step=34, return_result_steps=True)),
    ("group 3, per-pair splits, result steps, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(lopsided_walks=True, return_result_steps=True)),
    ("group 4, after a wave, one split", 32, 8, 128, torch.bfloat16, True, dict(num_splits=1, wave_steps=4)),
    ("group 3, after a wave, deferred followers, ragged, D 64", 9, 3, 64, torch.bfloat16, True,
     dict(num_splits=5, follow_step=20, ragged=True, wave_steps=4, return_result_steps=True)),
]


def _compile_requests(labels: list[str], recorded) -> list[dict]:
    """``_compile_request`` of each launch ``recorded`` (``conftest.KernelLaunches``), labelled in order."""
    return [_compile_request(label, recorded.kernel.arg_names, call) for label, call in zip(labels, recorded.calls)]


def _compile_for_sm90(launches: list[dict]) -> subprocess.CompletedProcess:
    """Compiles ``_compile_request``'s ``launches`` for sm_90 in a subprocess without the interpreter (a launch with a
    ``cubin`` path writes its cubin there); fails the test if any does not compile."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], input=json.dumps(launches), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"compiling for sm_90 failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done


def _launch(q_heads, kv_heads, head_dim, dtype, art, *, ragged=False, paged=False, page_size=16, lopsided_walks=False,
            **kwargs):
    """One ``art_decode`` call of a ``CASES`` entry on small CPU tensors (``lopsided_walks``: per-pair splits, one
    pair expected to walk the whole 64 blocks and the others 10)."""
    batch, seqlen = 2, 4096
    q = torch.zeros(batch, q_heads, head_dim, dtype=dtype)
    k = torch.zeros(batch, kv_heads, seqlen, head_dim, dtype=dtype)
    layout = {}
    if paged:
        k = torch.zeros(batch * seqlen // page_size, page_size, kv_heads, head_dim, dtype=dtype)
        layout["block_table"] = torch.arange(batch * seqlen // page_size, dtype=torch.int32).view(batch, -1)
    if ragged:
        layout["cache_seqlens"] = torch.tensor([seqlen, 1000], dtype=torch.int32)
    params = ARTConfig().kernel_params() if art else None
    if lopsided_walks:
        walks = torch.full((batch, kv_heads), 10)
        walks[0, 0] = seqlen // 64
        kwargs["pair_walks"] = PairWalks.from_walks(walks)
    art_decode(q, k, k.clone(), art=params, **layout, **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's CUDA backend (ptxas ships with the triton wheel)")
def test_every_launch_configuration_compiles_for_sm90(record_decode_launches):
    recorded = record_decode_launches()
    for _, q_heads, kv_heads, head_dim, dtype, art, kwargs in CASES:
        _launch(q_heads, kv_heads, head_dim, dtype, art, **kwargs)
    assert len(recorded.calls) == len(CASES)
    launches = _compile_requests([case[0] for case in CASES], recorded)
    done = _compile_for_sm90(launches)
    assert done.stdout.count("SASS bytes") == len(CASES), done.stdout
    # only the on-demand followers sleep between their polls
    sleeping = [line.split(" SASS")[0] for line in done.stdout.splitlines() if line.endswith("True")]
    assert sleeping == [case[0] for case in CASES if "release_walks" in case[-1]], done.stdout


def _mma_loops(launches: list[dict], folder: Path) -> dict:
    """Each launch's innermost MMA loops (``kernels.step_schedule``), compiled for sm_90 by the installed Triton."""
    from kernels.step_schedule import mma_loop_schedules

    for number, launch in enumerate(launches):
        launch["cubin"] = str(folder / f"{number}.cubin")
    _compile_for_sm90(launches)
    return {launch["label"]: mma_loop_schedules(Path(launch["cubin"]).read_bytes()) for launch in launches}


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's CUDA backend (nvdisasm ships with the triton wheel)")
def test_the_step_schedule_finds_the_monitored_step_loop(record_decode_launches, tmp_path):
    """The SASS reader finds, in a one-split build, a loop of one monitored step's MMAs per warp (``BLOCK_N * D /
    (64 * warps)``: the ``q K^T`` and ``P V`` m16n8k16 products of a 64-token block) and reads a stall of at least a
    cycle per instruction from the control bits."""
    recorded = record_decode_launches()
    cases = [("D 128", 32, 8, 128), ("D 64", 9, 3, 64)]
    for _, q_heads, kv_heads, head_dim in cases:
        _launch(q_heads, kv_heads, head_dim, torch.bfloat16, True, num_splits=1)
    launches = _compile_requests([case[0] for case in cases], recorded)
    loops = _mma_loops(launches, tmp_path)
    for (label, _, _, head_dim), launch in zip(cases, launches):
        step_mmas = launch["constexprs"]["BLOCK_N"] * head_dim // (64 * launch["options"]["num_warps"])
        assert any(loop.mmas == step_mmas for loop in loops[label]), (label, step_mmas, loops[label])
        assert all(loop.stall_cycles >= loop.instructions for loop in loops[label]), loops[label]


@pytest.mark.gpu
def test_gpu_default_plan_builds_interleave_the_step_mmas(record_decode_launches, tmp_path):
    """The GPU machine's Triton schedules the monitored step's ``q K^T`` MMA chains interleaved, not one after
    another (at most 2 MMAs waiting on their predecessor's latency per loop; a serialised 128-dim step has 17 and
    walks 24 % slower), in the default plan's builds (one split at B = 128 and deferred followers at small batch) and
    in ``on_demand_plan``'s, D = 128 and 64.  ptxas takes that decision from code around the loop
    (``kernels.step_schedule``; ``benchmarks/NOTES-art-decode.md``, V54, V57)."""
    from kernels.split_plan import on_demand_plan

    recorded = record_decode_launches()
    params = ARTConfig().kernel_params()
    cases = [("D 128, one split", 128, 8192, 32, 8, 128, "one split"),
             ("D 128, deferred followers", 8, 32768, 32, 8, 128, "deferred"),
             ("D 128, on-demand followers", 128, 32768, 32, 8, 128, "on demand"),
             ("D 64, one split", 128, 32768, 9, 3, 64, "one split"),
             ("D 64, deferred followers", 32, 32768, 9, 3, 64, "deferred"),
             ("D 64, on-demand followers", 128, 32768, 9, 3, 64, "on demand")]
    device = torch.device("cuda")
    for _, batch, seqlen, q_heads, kv_heads, head_dim, plan in cases:
        q = torch.empty(batch, q_heads, head_dim, dtype=torch.bfloat16, device=device)
        k = torch.empty(batch, kv_heads, seqlen, head_dim, dtype=torch.bfloat16, device=device)
        keywords = on_demand_plan(seqlen // 64, device, params) if plan == "on demand" else {}
        art_decode(q, k, k, art=params, **keywords)
        del q, k
    launches = _compile_requests([case[0] for case in cases], recorded)
    for (label, *_, plan), launch in zip(cases, launches):
        built = {name: launch["constexprs"][name] for name in ("SINGLE_SPLIT", "DEFERRED", "ON_DEMAND")}
        assert built == {"SINGLE_SPLIT": plan == "one split", "DEFERRED": plan == "deferred",
                         "ON_DEMAND": plan == "on demand"}, (label, built)
    loops = _mma_loops(launches, tmp_path)
    for label, schedules in loops.items():
        assert schedules and all(loop.serialised_mmas <= 2 for loop in schedules), (label, schedules)


WAVE_KERNELS = ("wave_attend_kernel", "wave_monitor_kernel", "wave_finish_kernel")


def _wave_launches(monkeypatch, calls) -> dict[str, list[dict]]:
    """The compile requests (``_compile_request``) of each ``kernels.art_wave`` kernel's launches in the ``art_decode``
    ``calls`` (``(q, k, v, keywords)``; the split kernel is not launched), by kernel name, in call order."""
    import kernels.art_wave as art_wave_module
    from conftest import KernelLaunches

    recorded = {}
    for name in WAVE_KERNELS:
        recorded[name] = KernelLaunches(getattr(art_wave_module, name), forward=False)
        monkeypatch.setattr(art_wave_module, name, recorded[name])
    monkeypatch.setattr("kernels.art_decode.art_decode_split_kernel", KernelLaunches(None, forward=False))
    for q, k, v, keywords in calls:
        art_decode(q, k, v, **keywords)
    requests = {}
    for name, kernel_launches in recorded.items():
        kernel = getattr(art_wave_kernel, name)
        requests[name] = [{**_compile_request(f"{name} {number}", kernel.arg_names, call, WAVE_UNSPECIALISED_INTS),
                           "module": "art_wave_kernel", "kernel": name}
                          for number, call in enumerate(kernel_launches.calls)]
    return requests


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's CUDA backend (ptxas ships with the triton wheel)")
def test_the_wave_kernels_compile_for_sm90(monkeypatch):
    """The three kernels of ``kernels.art_wave`` compile for sm_90: contiguous and paged, uniform and ragged, both
    orders, groups of 1, 4 and 20 query heads (a finishing program writes 16 at once), D = 64 and 128, and each
    monitor build (output or accumulator probe, all or MMA dims, relative or absolute scale, each direction build),
    and a wave longer than one step tile (``WAVE_STEP_TILE``: its monitor and finish loop over the tiles)."""
    configs = [ARTConfig(), ARTConfig(probe_source="accumulator", probe_dims="mma", scale="absolute", phi=0.0),
               ARTConfig(use_direction=False, phi=2.0)]
    layouts = [(1, 1, 64, dict(order="sequential")), (32, 8, 128, {}), (20, 1, 64, dict(ragged=True)),
               (8, 2, 128, dict(paged=True, ragged=True)), (8, 2, 64, dict(steps=136))]
    calls = []
    for index, (q_heads, kv_heads, head_dim, layout) in enumerate(layouts):
        q = torch.zeros(2, q_heads, head_dim, dtype=torch.bfloat16)
        steps = layout.get("steps", 2)
        k = torch.zeros(2, kv_heads, max(1024, steps * 64), head_dim, dtype=torch.bfloat16)
        keywords = {"order": layout.get("order", "sink_recency"), "wave_steps": steps, "num_splits": 1,
                    "art": configs[index % len(configs)].kernel_params()}
        if layout.get("paged"):
            k = torch.zeros(2 * 1024 // 16, 16, kv_heads, head_dim, dtype=torch.bfloat16)
            keywords["block_table"] = torch.arange(2 * 1024 // 16, dtype=torch.int32).view(2, -1)
        if layout.get("ragged"):
            keywords["cache_seqlens"] = torch.tensor([1024, 100], dtype=torch.int32)
        calls.append((q, k, k.clone(), keywords))
    launches = [launch for requests in _wave_launches(monkeypatch, calls).values() for launch in requests]
    done = _compile_for_sm90(launches)
    assert done.stdout.count("SASS bytes") == 3 * len(layouts), done.stdout


def test_round_trips_split_the_loads_at_each_use_of_a_loaded_register():
    from kernels.step_schedule import round_trips

    listing = ["@!P1 LDG.E.128 R4, desc[UR6][R2.64]",       # R4-R7
               "@P0 LDG.E R8, desc[UR6][R2.64+0x10]",
               "FSETP.GT.AND P4, PT, |R12|, 1, PT",          # reads no loaded register
               "FADD R9, RZ, R10",
               "FSETP.GEU.AND P5, PT, |R7|, 1, PT",          # reads R7 (the first load): a new round trip
               "LDG.E R10, desc[UR6][R2.64+0x20]",
               "STS [R1], R8",                               # a store reads all of its operands
               "LDG.E.64 R12, desc[UR6][R10.64]",            # its address is the load before
               "FADD R14, R12, R13",
               "LDGSTS.E.BYPASS.128 [R20], desc[UR6][R2.64]",  # a copy to shared memory: not a load to registers
               "@UP0 UTMALDG.2D [UR24], [UR12]"]
    assert round_trips(listing) == [2, 1, 1]
    assert round_trips(listing[:4]) == [2]
    assert round_trips(["FADD R1, R2, R3"]) == []


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="needs Triton's CUDA backend (nvdisasm ships with the triton wheel)")
def test_the_wave_kernels_load_in_few_round_trips(monkeypatch, tmp_path):
    """At the told wave's shape (W = 48, D = 128, group 4, ``ARTConfig()``) the sm_90 builds of the wave wait on memory
    no more often than their loads need (``kernels.step_schedule.load_round_trips``): the read takes 2 round trips
    (q and K, then V: K's store to shared memory waits for K), the monitor 3 (the blocks' states, which its scans of
    the maxima split once, then the states before each step after its barrier; used as loaded, its first loads took
    five) and the finish 3 (the chunks' sums of both steps, then the rows at the stop; summed as loaded, four)."""
    from kernels.step_schedule import load_round_trips

    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 8, 48 * 64, 128, dtype=torch.bfloat16)
    requests = _wave_launches(monkeypatch, [(q, k, k.clone(), dict(art=ARTConfig().kernel_params(), wave_steps=48,
                                                                    num_splits=1))])
    launches = [{**requests[name][0], "cubin": str(tmp_path / f"{name}.cubin")} for name in WAVE_KERNELS]
    _compile_for_sm90(launches)
    trips = {name: load_round_trips((tmp_path / f"{name}.cubin").read_bytes()) for name in WAVE_KERNELS}
    limits = {"wave_attend_kernel": 2, "wave_monitor_kernel": 3, "wave_finish_kernel": 3}
    assert all(len(trips[name]) <= limits[name] for name in WAVE_KERNELS), trips


def test_the_unspecialised_ints_name_the_kernels_arguments():
    # Triton skips a do_not_specialize name that is not an argument without a word: a misspelt threshold would be
    # specialised again, and a sweep of it would compile a build per value class
    arguments = inspect.signature(art_decode_split_kernel.fn).parameters
    assert set(UNSPECIALISED_INTS) <= {name for name, p in arguments.items() if p.annotation is inspect.Parameter.empty}
    assert {"patience", "first_counted"} <= set(UNSPECIALISED_INTS)
