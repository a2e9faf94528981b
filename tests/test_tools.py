"""tools/same_sass.py, tools/kernel_resources.py and tools/loads_in_flight.py: CPU checks of what a kernel-source
change does to the machine code; tools/model_survey.py: what the library matches in model families beyond the benchmark."""

import os
import re
import sys
from pathlib import Path

import pytest

from fxkern import compiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import kernel_resources  # noqa: E402
import loads_in_flight  # noqa: E402
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


# ---- tools/loads_in_flight.py: global loads outstanding at once, read from the disassembly ---------


def test_loads_are_outstanding_until_a_register_of_theirs_is_read_or_written():
    walk = loads_in_flight.loads_in_flight
    together = ["@P0 LDG.E.128 R16, desc[UR10][R2.64] ;", "@!P1 LDG.E.128 R20, desc[UR10][R4.64] ;",
                "LDG.E.U16 R24, desc[UR10][R6.64] ;", "FADD R8, R19, R23 ;", "FADD R9, R24, R8 ;"]
    assert walk(together) == loads_in_flight.Loads(wide=2, wide_in_flight=2, all=3, all_in_flight=3)
    # each pack used before the next is loaded: one in flight
    one_by_one = ["LDG.E.128 R16, desc[UR10][R2.64] ;", "PRMT R52, R16, 0x7610, R16 ;",
                  "LDG.E.128 R16, desc[UR10][R4.64] ;", "PRMT R51, R17, 0x7610, R17 ;"]
    assert walk(one_by_one).wide_in_flight == 1
    # an address pair holding a pending register (R17 of R16..R19) waits too, as does overwriting one
    assert walk(["LDG.E.128 R16, desc[UR4][R2.64] ;", "LDG.E R4, desc[UR4][R16.64] ;"]).all_in_flight == 1
    assert walk(["LDG.E.64 R16, desc[UR4][R2.64] ;", "MOV R17, RZ ;", "LDG.E.64 R18, desc[UR4][R2.64+0x8] ;",
                 "FADD R0, R18, R19 ;"]).all_in_flight == 1
    # stores read their operands: a store of a loaded pack waits for it
    assert walk(["LDG.E.128 R8, desc[UR4][R2.64] ;", "LDG.E.128 R12, desc[UR4][R2.64+0x10] ;",
                 "STG.E.128 desc[UR4][R4.64], R8 ;"]).wide_in_flight == 2


# Eight independent 16-byte loads summed, and eight whose addresses each come from the load before
# (a chain: the thread has to wait for each).
EIGHT = r"""
extern "C" __global__ void eight(const float4* x, float* y) {
    float4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = x[threadIdx.x + k * 256];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[k].x + v[k].y + v[k].z + v[k].w;
    y[threadIdx.x] = s;
}
extern "C" __global__ void chained(const int4* x, int* y) {
    int i = threadIdx.x, s = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int4 v = x[i];
        s += v.y + v.z + v.w;
        i = v.x;
    }
    y[threadIdx.x] = s;
}
"""


def test_loads_in_flight_of_compiled_kernels(fresh_cache, nvdisasm):
    cubin = compiler.compile_source(EIGHT, [], arch="sm_90").cubin
    walked = {name: loads_in_flight.loads_in_flight(code) for name, code in same_sass.functions(cubin, nvdisasm).items()}
    # (ptxas may start the sum once seven are out, and issue the eighth after it)
    assert walked["eight"].wide == 8 and walked["eight"].wide_in_flight >= 6
    assert walked["chained"].wide == 8 and walked["chained"].wide_in_flight == 1


def test_the_softmax_edges_kernels_load_a_threads_packs_before_using_any(nvdisasm):
    """The plain softmax's EDGES kernels (rows of an odd length) issue all of a thread's 16-byte loads
    before they wait on one. With the -inf padding beside each load, nvcc waited on every pack before
    the next load (one in flight), and bfloat16 rows of 1001 ran at 0.72x inductor on an H200."""
    import fxkern
    from fxkern.library import softmax

    edges = {suffix: spec for suffix, spec in softmax.SOFTMAX_GRIDS.items() if suffix.endswith(softmax.EDGES)}
    assert len(edges) == 4
    for suffix, spec in edges.items():  # compiled as the library registers them, under names of the test's own
        qualname = f"fxkern_test_tools::softmax_rows{suffix}"
        fxkern.cuda_kernel_op(qualname, spec)
        for kernel, code in same_sass.functions(fxkern.kernel_op(qualname).compiled.cubin, nvdisasm).items():
            loads = loads_in_flight.loads_in_flight(code)
            assert loads.wide >= 4 and loads.wide_in_flight == loads.wide, (suffix, same_sass.kernel_name(kernel))


# ---- tools/kernel_resources.py: ptxas's register and spill report, read on the CPU ----------------


ROOMY = r"""
extern "C" __global__ void roomy(const float* x, int n, float* y) {
    __shared__ float tile[64];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x & 63] = i < n ? x[i] : 0.0f;
    __syncthreads();
    if (i < n) y[i] = tile[(threadIdx.x + 1) & 63];
}
"""
# 96 floats live across a sum of them all, under launch bounds that leave 32 registers: ptxas spills.
CROWDED = r"""
extern "C" __global__ void __launch_bounds__(1024, 2) crowded(const float4* x, float4* y) {
    float4 v[24];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 24; ++k) {
        v[k] = x[threadIdx.x + k * 1024];
        s += v[k].x + v[k].y + v[k].z + v[k].w;
    }
#pragma unroll
    for (int k = 0; k < 24; ++k)
        y[threadIdx.x + k * 1024] = make_float4(v[k].x * s, v[k].y * s, v[k].z * s, v[k].w * s);
}
"""


def _report(source):
    log = compiler.compile_source(source, [], arch="sm_90", extra_options=kernel_resources.report_options()).log
    return {u.kernel: u for u in kernel_resources.parse(log)}


def test_resources_of_a_kernel_that_fits(fresh_cache):
    report = _report(ROOMY)
    assert list(report) == ["roomy"]
    u = report["roomy"]
    assert 0 < u.registers <= 32 and not u.spills and u.stack == 0
    assert u.smem == 64 * 4


def test_resources_name_a_kernel_that_spills(fresh_cache):
    u = _report(CROWDED)["crowded"]
    assert u.registers <= 32  # what its launch bounds leave a thread
    assert u.spills and u.spill_stores > 0 and u.spill_loads > 0 and u.stack > 0


def test_the_report_is_its_own_cache_entry(fresh_cache):
    # The plain compile (what registration caches) keeps a quiet log; the report's options make another entry.
    assert "Used" not in compiler.compile_source(ROOMY, [], arch="sm_90").log
    assert "roomy" in _report(ROOMY)


def test_resources_of_a_registered_op_cover_each_instantiation(fresh_cache):
    import torch

    import fxkern
    from fxkern import Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, SameAs

    src = r"""
template <typename T>
__global__ void twice(const T* x, int n, T* y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] + x[i];
}
"""
    spec = KernelSpec(src, "twice", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[Numel("x")], geometry=Elementwise(), dtypes=[torch.float32, torch.float16])
    fxkern.cuda_kernel_op("fxkern_test_tools::twice", spec)
    report = kernel_resources.usage(fxkern.kernel_op("fxkern_test_tools::twice"))
    assert sorted(same_sass.kernel_name(u.kernel) for u in report) == ["twice<__half>", "twice<float>"]
    assert all(u.registers > 0 and not u.spills for u in report)


def test_early_uses_counts_instructions_reading_a_load_before_the_last_is_issued():
    import rope_loads

    grouped = ["LDG.E.128 R4, desc[UR4][R2.64] ;", "LDG.E.128 R8, desc[UR4][R2.64+0x80] ;"] + [
        f"LDG.E.128 R{12 + 4 * k}, desc[UR4][R20.64+0x{k}0] ;" for k in range(4)] + ["HMUL2.BF16_V2 R4, R4, R12 ;"]
    assert rope_loads.early_uses(grouped) == (5, 0)
    split = grouped[:4] + ["HMUL2.BF16_V2 R5, R5, R13 ;", "HADD2.BF16_V2 R30, R9, R14 ;"] + grouped[4:6]
    assert rope_loads.early_uses(split) == (7, 2)


def test_rows_written_once_issue_a_rotated_items_six_loads_before_using_any(nvdisasm):
    """The eager path's rotary kernel for rows written once keeps a rotated item's six 16-byte loads (x's two
    halves, cos's, sin's) in flight together in every dtype: one trip to memory an item. At 50 registers
    ptxas used the bfloat16 kernel's first four before issuing the last two, 2.5-6% slower on an H200
    (rotary.py, rotary_rows). A failure after an NVRTC or source change means: re-measure
    (benchmarks/rope_tuning.py), not that results are wrong."""
    import rope_loads

    import fxkern
    import fxkern.library
    from fxkern import ops
    from fxkern.library import rotary

    fxkern.library.rules()
    entry = fxkern.kernel_op(rotary.STRIDED)
    cubin = ops.compile_plan(entry.plan, entry.source, "sm_90").cubin
    kernels = same_sass.functions(cubin, nvdisasm)
    assert len(kernels) == 3
    for name, code in kernels.items():
        assert rope_loads.early_uses(code)[1] == 0, (same_sass.kernel_name(name), rope_loads.early_uses(code))


def test_model_survey_rewrites_families_beyond_the_benchmark_and_lists_what_is_left(capsys):
    """tools/model_survey.py on two families: each one's library calls, its output the export's to the bit,
    and (``--leftover``) the ops left that library kernels compute, by transformers source line."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")
    import model_survey

    assert model_survey.main(["--models", "cohere,gptj", "--dtype", "bfloat16", "--leftover"]) == 0
    out = capsys.readouterr().out
    assert "cohere: add_cohere_layer_norm x2, cohere_layer_norm x1," in out and out.count("output exact") == 2
    # GPT-J's interleaved rotary is one op (its stack is not left), and its first layer's norm, which no
    # residual add precedes, is PyTorch's LayerNorm
    assert "partial_interleaved_rotary_embedding x4" in out and "left: stack" not in out
    assert re.search(r"left: layer_norm @ models/gptj/modeling_gptj\.py:\d+", out)
    with pytest.raises(SystemExit):
        model_survey.main(["--models", "no_such_family"])
