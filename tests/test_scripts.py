"""The shell scripts that drive the GPU runs parse, and the Python they embed compiles: a script that fails
to parse costs a GPU session its start-up before it reports anything."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_decode_memcheck_program_compiles():
    text = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_decode.sh").read_text()
    match = re.search(r"^memcheck_run='\n(.*?)^'$", text, flags=re.S | re.M)
    assert match, "scripts/gpu_decode.sh: no memcheck_run='...' block"
    compile(match.group(1), "memcheck_run", "exec")


def test_pack_capture_layer_round_trips_bit_for_bit_and_smaller(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    root = Path(__file__).resolve().parents[1]
    torch.manual_seed(0)
    tensors = {"k": torch.randn(2, 3, 512, 64).to(torch.float16), "v": torch.randn(2, 3, 512, 64).to(torch.bfloat16),
               "decode_q": torch.randn(2, 9, 64), "positions": torch.arange(7)}
    layer = tmp_path / "layer_015.safetensors"
    save_file(tensors, str(layer))
    packed, unpacked = tmp_path / "layer.xz", tmp_path / "out" / "layer_015.safetensors"
    for action, source, dest in (("pack", layer, packed), ("unpack", packed, unpacked)):
        result = subprocess.run([sys.executable, str(root / "scripts" / "pack_capture_layer.py"), action, str(source),
                                 str(dest)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    back = load_file(str(unpacked))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))
    assert packed.stat().st_size < 0.8 * layer.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.xz", "layer_015.safetensors", "out"]
    not_packed = subprocess.run([sys.executable, str(root / "scripts" / "pack_capture_layer.py"), "unpack", str(layer),
                                 str(tmp_path / "x.safetensors")], capture_output=True, text=True)
    assert not_packed.returncode != 0 and "is not a layer packed by this script" in not_packed.stderr
    # a cut packed file, a source that is no layer and a folder as the destination: errors, and no partial file left
    cut = tmp_path / "cut.xz"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    for action, source, dest, message in (("unpack", cut, tmp_path / "y.safetensors", "Compressed file ended"),
                                          ("pack", cut, tmp_path / "z.xz", "pack: error:"),
                                          ("pack", layer, tmp_path / "out", "is a folder: name the file to write")):
        failed = subprocess.run([sys.executable, str(root / "scripts" / "pack_capture_layer.py"), action, str(source),
                                 str(dest)], capture_output=True, text=True)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.xz", "layer.xz", "layer_015.safetensors", "out"]


def test_gpu_decode_refuses_to_resume_from_a_result_bench_resume_would_not_find(tmp_path):
    """`bench --resume` continues a ``<date>-art-decode.json`` in the output folder: a renamed partial result would be
    ignored and the whole run timed afresh, so the script stops before the benchmark and says why."""
    root = Path(__file__).resolve().parents[1]
    partial = tmp_path / "resume.json"
    partial.write_text("{}")
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "SKIP_TESTS": "1", "RESUME_FROM": str(partial)}
    result = subprocess.run(["bash", str(root / "scripts" / "gpu_decode.sh")], capture_output=True, text=True,
                            cwd=root, env=env)
    assert result.returncode == 2
    assert "continues a result named <date>-art-decode.json" in result.stderr
    assert not (out / "decode_bench.log").exists() and not (out / "resume.json").exists()


def test_gpu_decode_runs_only_the_gpu_tests_tests_k_selects(tmp_path):
    """``TESTS_K`` reaches pytest's ``-k``: a short call runs a subset of the GPU tests and memcheck (here, without
    a GPU, hidden where there is one, the selected tests are collected and skipped, the rest deselected)."""
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "SKIP_BENCH": "1", "CUDA_VISIBLE_DEVICES": ""}
    logs = {}
    for name, select in (("subset", {"TESTS_K": "per_pair_splits or on_the_gpu"}), ("all", {})):
        out = tmp_path / name
        result = subprocess.run(["bash", str(root / "scripts" / "gpu_decode.sh")], capture_output=True, text=True,
                                cwd=root, env={**env, **select, "OUT": str(out)})
        assert result.returncode == 0, result.stderr
        logs[name] = (out / "decode_gpu_tests.log").read_text()
    subset = re.search(r"(\d+) skipped, (\d+) deselected", logs["subset"])
    every = re.search(r"(\d+) skipped, (\d+) deselected", logs["all"])
    assert subset and every, (logs["subset"], logs["all"])
    assert int(subset.group(1)) == 4 and int(every.group(1)) > 4
    assert int(subset.group(1)) + int(subset.group(2)) == int(every.group(1)) + int(every.group(2))


@pytest.mark.parametrize("script, argv, message", [
    ("simulator_speed.py", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ("simulator_speed.py", ["--out", "{file}"], "--out '{file}' is not a folder"),
    ("capture_speed.py", ["--decode-steps", "0"], "--decode-steps must be >= 1, got 0"),
    ("capture_speed.py", ["--out", "{file}/x.json"], "its folder '{file}' exists and is not a folder"),
    ("art_decode_walk_model.py", ["{file}", "--out", "x.json"], "is not valid JSON"),
    ("art_decode_walk_model.py", ["{old_run}", "--out", "x.json"], "lacks lone_walk: the walk model needs a decode run "
                                                                   "of 2026-12-01 or later"),
])
def test_cpu_speed_scripts_name_bad_options_before_any_work(script, argv, message, tmp_path):
    root = Path(__file__).resolve().parents[1]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    old_run = tmp_path / "old.json"
    old_run.write_text('{"suite": "decode", "art": {}, "rows": []}')             # a run before the lone walk was timed
    argv = [a.replace("{file}", str(a_file)).replace("{old_run}", str(old_run)) for a in argv]
    result = subprocess.run([sys.executable, str(root / "benchmarks" / script), *argv], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)}, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and message.replace("{file}", str(a_file)) in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "old.json"]
