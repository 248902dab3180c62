"""The shell scripts that drive the GPU runs parse, and the Python they embed compiles: a script that fails
to parse costs a GPU session its start-up before it reports anything."""
import re
import subprocess
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
