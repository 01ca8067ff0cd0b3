"""Every Python block of README.md runs as written (CPU: small shapes, the interpreter), each in a fresh
interpreter, with 4 host devices so that the ring example's mesh has a ring."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_readme_has_examples():
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               DUALATTN_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", BLOCKS[index]], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"README block {index} failed:\n{BLOCKS[index]}\n{done.stderr[-3000:]}"
