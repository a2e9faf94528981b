"""Two GPUs: the demo's rewritten model, data parallel under torchrun, one process per GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multi_gpu
def test_ddp_demo_correct_on_both_ranks_and_compiles_each_kernel_once(tmp_path):
    env = {**os.environ, "FXKERN_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "examples" / "ddp_demo.py"), "--size", "small"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "rank 0 (cuda:0): ok" in run.stdout and "rank 1 (cuda:1): ok" in run.stdout, out
    assert "cold cache): each once" in run.stdout, out
