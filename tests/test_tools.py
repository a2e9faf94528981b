"""tools/same_sass.py: the CPU check that a kernel-source cleanup leaves the machine code alone."""

import os
import sys
from pathlib import Path

import pytest

from fxkern import compiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import same_sass  # noqa: E402

KERNEL = r"""
extern "C" __global__ void scale_kernel(const float* x, float alpha, int n, float* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * alpha;
}
"""


@pytest.fixture
def nvdisasm():
    """The disassembler the tool uses; CI installs it with the test extras, elsewhere it may be missing."""
    try:
        return same_sass.nvdisasm()
    except SystemExit as missing:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(missing))


def _cubins(tmp_path, name, **sources):
    """Each source compiled for sm_90 into tmp_path/name/<op>.cubin, as same_sass.dump writes them."""
    out = tmp_path / name
    out.mkdir()
    for op, src in sources.items():
        (out / f"fxkern_lib__{op}.cubin").write_bytes(compiler.compile_source(src, [], arch="sm_90").cubin)
    return out


def test_a_source_edit_that_changes_no_instruction_reads_the_same(fresh_cache, tmp_path, nvdisasm):
    reworded = "// the same kernel, written again\n" + KERNEL.replace("int i =", "const int i =")
    base = _cubins(tmp_path, "base", scale=KERNEL)
    new = _cubins(tmp_path, "new", scale=reworded)
    assert same_sass.compare(base, new, nvdisasm) == []


def test_changed_code_and_a_missing_op_are_named(fresh_cache, tmp_path, nvdisasm):
    base = _cubins(tmp_path, "base", scale=KERNEL, gone=KERNEL)
    new = _cubins(tmp_path, "new", scale=KERNEL.replace("x[i] * alpha", "x[i] * alpha + 1.0f"))
    lines = same_sass.compare(base, new, nvdisasm)
    assert lines[0] == "fxkern_lib::gone: only in BASE"
    assert lines[1].startswith("fxkern_lib::scale: differs in scale_kernel (")
    assert len(lines) == 2


def test_kernel_names_keep_the_instantiation():
    assert same_sass.kernel_name("_Z12softmax_lastI13__nv_bfloat16EvPKT_iiPS1_") == "softmax_last<__nv_bfloat16>"
    assert same_sass.kernel_name("_Z12softmax_lastIfEvPKT_iiPS0_") == "softmax_last<float>"
    assert same_sass.kernel_name("scale_kernel") == "scale_kernel"
