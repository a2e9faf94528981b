import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# A cache of the test session's own, so tests never read a user's cache.
os.environ.setdefault("FXKERN_CACHE_DIR", tempfile.mkdtemp(prefix="fxkern-test-cache-"))
# inductor's too: a graph found in its FX graph cache skips fxkern's pass, so a test asserting on the
# pass's report failed on a second run of the suite, whose graphs the first had cached
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fxkern-test-inductor-"))


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible (CI has none: run tools/gpu_suite.sh on the device)")
    one_gpu = pytest.mark.skip(reason=f"needs two CUDA GPUs; {n_gpus} visible")
    for item in items:
        if "multi_gpu" in item.keywords and n_gpus < 2:
            item.add_marker(one_gpu if n_gpus else no_gpu)
        elif "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(no_gpu)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache for this test, and zeroed compile counters."""
    from fxkern import compiler

    monkeypatch.setenv("FXKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(compiler.stats, "compiles", 0)
    monkeypatch.setitem(compiler.stats, "hits", 0)
    return tmp_path / "cache"


_counter = [0]


@pytest.fixture
def op_name():
    """A fresh op name per test, so registrations never collide."""
    _counter[0] += 1
    return f"fxkern_test::op{_counter[0]}_{os.getpid()}"
