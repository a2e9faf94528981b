"""fxkern.library kernels on the GPU against their references (the patterns).

The kernels compute in float32 and round once (keeping the pattern's explicit casts), so each
result is compared, elementwise (``torch.testing.assert_close``), with

* the pattern run in float32 on the same inputs and rounded to the dtype: rtol = atol = 1e-5 for
  float32 (summation order and special-function ulps), 2e-3 for float16 and 1.6e-2 for
  bfloat16 (two units in the last place: an explicit cast rounds an intermediate);
* the pattern run by eager PyTorch in the dtype, which also rounds every intermediate: the same
  in float32, 1e-2/5e-3 (rtol/atol) for float16 and 5e-2/3e-2 for bfloat16 (a written-out GELU
  rounded after each of its eight ops drifts that far where ``1 + tanh`` cancels);
* for float32, a float64 run of the pattern: relative norm error under 1e-5.
"""

import dataclasses
import itertools

import pytest
import torch

import fxkern
import fxkern.library as lib
from fxkern import split
from fxkern.library import (deinterleaved_rotary, gelu, interleaved_rotary, layernorm, norm_rotary, rmsnorm, rotary,
                            softmax, swiglu)

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}
EAGER_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 5e-3), torch.bfloat16: (5e-2, 3e-2)}
# Row lengths: 1 and 7 (no 16-byte access fits), a warp's worth, not a multiple of the vector
# width, the register-resident kernel's limits, and rows long enough for its long-row branch (read
# twice) and for the plain norms' two-read kernel.
ROW_LENGTHS = (1, 7, 32, 100, 1023, 1024, 4097, 8192, 8200, 20011, 32768)
ROWS = 5


@pytest.fixture(scope="module", autouse=True)
def library_rules():
    return lib.rules()


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def row_case(x_scale=1.0, offset=0.0):
    def make(rows, d, dtype):
        return (rand(rows, d, dtype=dtype, scale=x_scale) + offset, rand(d, dtype=dtype), 1e-6)
    return make


def add_row_case(make_rows):
    """A residual add before the norm: (x, residual, weight, eps)."""
    def make(rows, d, dtype):
        x, w, eps = make_rows(rows, d, dtype)
        return (x, rand(rows, d, dtype=dtype), w, eps)
    return make


def ew_case(n_full, with_bias):
    def make(rows, d, dtype):
        args = [rand(rows, d, dtype=dtype, scale=2.0)]
        if with_bias:
            args.append(rand(d, dtype=dtype))
        args += [rand(rows, d, dtype=dtype) for _ in range(n_full - 1)]
        return tuple(args)
    return make


CASES = {
    "rms_norm": (rmsnorm.llama_rmsnorm, row_case()),
    "gemma_rms_norm": (rmsnorm.gemma_rmsnorm, row_case()),
    "torch_rms_norm": (rmsnorm.torch_rms_norm, lambda rows, d, dtype: (rand(rows, d, dtype=dtype), rand(d, dtype=dtype), d, 1e-6)),
    "torch_rms_norm_default_eps": (rmsnorm.torch_rms_norm_default_eps,
                                   lambda rows, d, dtype: (rand(rows, d, dtype=dtype), rand(d, dtype=dtype), d)),
    "add_rms_norm": (rmsnorm.add_llama_rmsnorm, add_row_case(row_case())),
    "add_torch_rms_norm": (rmsnorm.add_torch_rms_norm, lambda rows, d, dtype: (
        rand(rows, d, dtype=dtype), rand(rows, d, dtype=dtype), rand(d, dtype=dtype), d, 1e-6)),
    "add_torch_rms_norm_default_eps": (rmsnorm.add_torch_rms_norm_default_eps, lambda rows, d, dtype: (
        rand(rows, d, dtype=dtype), rand(rows, d, dtype=dtype), rand(d, dtype=dtype), d)),
    "add_gemma_rms_norm": (rmsnorm.add_gemma_rmsnorm, add_row_case(row_case())),
    # litgpt's RMSNorm (x * x, the weight multiplied in float32): F.rms_norm's kernels
    "litgpt_rms_norm": (rmsnorm.litgpt_rmsnorm, row_case()),
    "add_litgpt_rms_norm": (rmsnorm.add_litgpt_rmsnorm, add_row_case(row_case())),
    # float32 rows off zero (mean 3) test the centred variance against float64; 16-bit ones stay
    # centred: the kernel rounds x + residual to the dtype, as eager does and the float32 reference
    # does not, and that rounding of values near 3 moves (h - mean) by more than the tolerance
    "add_layer_norm": (layernorm.add_layer_norm, lambda rows, d, dtype: (
        rand(rows, d, dtype=dtype, scale=2.0) + (3.0 if dtype == torch.float32 else 0.0), rand(rows, d, dtype=dtype),
        rand(d, dtype=dtype), rand(d, dtype=dtype), d, 1e-5)),
    # ModernBERT's nn.LayerNorm(bias=False): the same kernel, no bias read
    "add_layer_norm_no_bias": (layernorm.add_layer_norm_no_bias, lambda rows, d, dtype: (
        rand(rows, d, dtype=dtype, scale=2.0) + (3.0 if dtype == torch.float32 else 0.0), rand(rows, d, dtype=dtype),
        rand(d, dtype=dtype), d, 1e-5)),
    # Cohere's LayerNorm written out in float32: the bias-free kernel's arithmetic, with and without the add
    "add_cohere_layer_norm": (layernorm.add_cohere_layer_norm, add_row_case(row_case(2.0))),
    # rows off zero (mean 3) test the centred variance: the plain norm has no add to round, so in every dtype
    "cohere_layer_norm": (layernorm.cohere_layer_norm, row_case(2.0, offset=3.0)),
    # OLMo 1's: neither weight nor bias, in float32; rows off zero as above
    "add_olmo_layer_norm": (layernorm.add_olmo_layer_norm, lambda rows, d, dtype: (
        rand(rows, d, dtype=dtype, scale=2.0) + (3.0 if dtype == torch.float32 else 0.0), rand(rows, d, dtype=dtype),
        d, 1e-5)),
    "olmo_layer_norm": (layernorm.olmo_layer_norm, lambda rows, d, dtype: (rand(rows, d, dtype=dtype, scale=2.0) + 3.0,
                                                                           d, 1e-5)),
    "softmax": (softmax.softmax, lambda rows, d, dtype: (rand(rows, d, dtype=dtype, scale=4.0),)),
    "bias_gelu": (gelu.bias_gelu, ew_case(1, True)),
    "bias_gelu_residual": (gelu.bias_gelu_residual, ew_case(2, True)),
    "bias_gelu_tanh": (gelu.bias_gelu_tanh, ew_case(1, True)),
    "bias_gelu_tanh_residual": (gelu.bias_gelu_tanh_residual, ew_case(2, True)),
    "gelu_new": (gelu.gelu_new, ew_case(1, False)),
    "bias_gelu_new": (gelu.bias_gelu_new, ew_case(1, True)),
    "bias_gelu_new_residual": (gelu.bias_gelu_new_residual, ew_case(2, True)),
    "megatron_bias_gelu": (gelu.megatron_bias_gelu, ew_case(1, True)),
    "quick_gelu": (gelu.quick_gelu, ew_case(1, False)),
    "megatron_gelu": (gelu.megatron_gelu, ew_case(1, False)),
    "swiglu": (swiglu.swiglu, ew_case(2, False)),
    "geglu": (swiglu.geglu, ew_case(2, False)),
    "geglu_tanh": (swiglu.geglu_tanh, ew_case(2, False)),
    "geglu_new": (swiglu.geglu_new, ew_case(2, False)),
    # d is each half's width: x has rows of 2 * d
    "swiglu_chunked": (swiglu.swiglu_chunked, lambda rows, d, dtype: (rand(rows, 2 * d, dtype=dtype, scale=2.0),)),
    "swiglu_chunked_gate_last": (swiglu.swiglu_chunked_gate_last,
                                 lambda rows, d, dtype: (rand(rows, 2 * d, dtype=dtype, scale=2.0),)),
    "geglu_chunked": (swiglu.geglu_chunked, lambda rows, d, dtype: (rand(rows, 2 * d, dtype=dtype, scale=2.0),)),
    # ModernBERT's MLP: the GELU on the first half
    "geglu_chunked_gate_first": (swiglu.geglu_chunked_gate_first,
                                 lambda rows, d, dtype: (rand(rows, 2 * d, dtype=dtype, scale=2.0),)),
    # GPT-OSS's expert gate: d (gate, up) pairs a row, interleaved; values out to +-20 meet both clamps
    "clamped_swiglu": (swiglu.clamped_swiglu,
                       lambda rows, d, dtype: (rand(rows, 2 * d, dtype=dtype, scale=6.0), 1.702, 7.0, -7.0, 7.0)),
}


def poison():
    """Fill memory the caching allocator will hand out next with NaN, so unwritten outputs show."""
    junk = torch.full((1 << 24,), float("nan"), device="cuda")
    del junk


def upcast(args, dtype):
    return [a.to(dtype) if isinstance(a, torch.Tensor) else a for a in args]


def outputs(value):
    return value if isinstance(value, tuple) else (value,)


def check(name, pattern, args, dtype, op=None):
    """Each of the op's outputs (the library op ``name``, or ``op``) against the pattern's (see the
    module docstring for tolerances)."""
    op = op or lib.op(name)
    poison()
    gots = outputs(op(*args))
    wants = outputs(pattern(*args))
    assert len(gots) == len(wants)
    refs = outputs(pattern(*upcast(args, torch.float32))) if dtype != torch.float32 else ()
    exacts = outputs(pattern(*upcast(args, torch.float64))) if dtype == torch.float32 else ()
    for k, (got, want) in enumerate(zip(gots, wants)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.is_contiguous() or got.stride() == want.stride()  # contiguous, or eager's layout
        where = f"{name} output {k} {dtype} {tuple(args[0].shape)}"
        rtol, atol = EAGER_TOL[dtype]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{where} vs eager: {m}")
        if refs:
            rtol, atol = TOL[dtype]
            torch.testing.assert_close(got, refs[k].to(dtype), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{where} vs float32: {m}")
        if exacts and want.numel():
            rel = float((got.double() - exacts[k]).norm() / exacts[k].norm().clamp_min(1e-30))
            assert rel < 1e-5, f"{where}: rel. error vs float64 {rel:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference_on_odd_and_long_rows(name, dtype):
    pattern, make = CASES[name]
    torch.manual_seed(0)
    for d in ROW_LENGTHS:
        check(name, pattern, make(ROWS, d, dtype), dtype)
    # Many short rows: the warp-per-row layout, with a partial last block of rows.
    check(name, pattern, make(1000, 64, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rules_sharing_an_op_compute_its_numbers(dtype):
    """OLMo 2's norm runs litgpt's ops, and Bloom's float32 masked softmax the unscaled masked op: each
    op against the other form's pattern, on odd and long rows."""
    torch.manual_seed(11)
    for d in ROW_LENGTHS:
        check("litgpt_rms_norm", rmsnorm.olmo2_rmsnorm, row_case()(ROWS, d, dtype), dtype)
        check("add_litgpt_rms_norm", rmsnorm.add_olmo2_rmsnorm, add_row_case(row_case())(ROWS, d, dtype), dtype)
    for q, d in MASKED_SIZES:
        x = rand(2, 3, q, d, dtype=dtype, scale=8.0)
        for mask in masks_for(q, d, dtype):
            want = softmax.masked_softmax_float32(x, mask)
            poison()
            check_masked(lib.op("masked_softmax")(x, mask), want, f"masked_softmax_float32 {dtype} {tuple(mask.shape)}")


def runs_only(names: list[str], kernel: str) -> bool:
    """Whether the launches ``names`` (kernels_run) are ``kernel`` alone, its ``_repeat`` twin (the
    eager path's kernel for rows written more than once) told apart from it."""
    return bool(names) and all(kernel in n and (kernel.endswith("_repeat") or f"{kernel}_repeat" not in n)
                               for n in names)


def kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("name", ["rms_norm", "gemma_rms_norm", "torch_rms_norm", "cohere_layer_norm", "olmo_layer_norm"])
def test_plain_norms_run_the_two_read_kernel_on_long_rows(name):
    pattern, make = CASES[name]
    torch.manual_seed(2)
    kernel = name if name in ("gemma_rms_norm", "cohere_layer_norm", "olmo_layer_norm") else "rms_norm"
    by_size = rmsnorm.by_element_size(TWO_READ_TABLES[name])
    for rows, d, dtype, two_read in ((64, 8192, torch.float32, True), (64, 4096, torch.float32, True),
                                     (64, 2048, torch.float32, False), (16, 16384, torch.float32, True),
                                     (64, 8192, torch.bfloat16, True), (64, 4096, torch.bfloat16, False),
                                     (64, 8192, torch.float16, True), (16, 16384, torch.bfloat16, True)):
        args = make(rows, d, dtype)
        weight = args[1] if isinstance(args[1], torch.Tensor) else None  # OLMo 1's norm has none
        assert (rmsnorm.two_read_tuning(args[0], weight, by_size) is not None) == two_read
        names = kernels_run(lambda: lib.op(name)(*args))
        assert [n for n in names if kernel in n] and all(("two_read" in n) == two_read for n in names), names
        check(name, pattern, args, dtype)


PLAIN_NORMS = (("rms_norm", rmsnorm.llama_rmsnorm), ("gemma_rms_norm", rmsnorm.gemma_rmsnorm))
# The ops that pick the two-read kernel for long rows, each with its register-resident kernel
TWO_READ_NORMS = PLAIN_NORMS + (("cohere_layer_norm", layernorm.cohere_layer_norm),
                                ("olmo_layer_norm", layernorm.olmo_layer_norm))
# Each op's two-read tunings
TWO_READ_TABLES = {"rms_norm": rmsnorm.TWO_READ, "gemma_rms_norm": rmsnorm.TWO_READ, "torch_rms_norm": rmsnorm.TWO_READ,
                   "cohere_layer_norm": layernorm.COHERE_TWO_READ, "olmo_layer_norm": layernorm.COHERE_TWO_READ}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_register_resident_kernel_on_every_row_length(dtype):
    # The plain norms send long rows to the two-read kernel; their register-resident kernel (what
    # TensorRT plugins carry) must still be right on all of them, its long-row branch included.
    torch.manual_seed(4)
    for name, pattern in TWO_READ_NORMS:
        op = getattr(torch.ops.fxkern_lib, f"_{name}_rows")
        for d in ROW_LENGTHS:
            check(f"_{name}_rows", pattern, CASES[name][1](ROWS, d, dtype), dtype, op=op)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_plain_norms_read_transposed_heads_in_place_and_keep_their_layout(dtype):
    # Gemma 3 normalises attention's queries and keys after the transpose: (B, H, S, D) views of the
    # (B, S, H, D) projection. The norms read them where they lie, one kernel and no copy first, and
    # write the result in x's layout, as eager's ops do (and the op's fake impl says).
    torch.manual_seed(5)
    for name, pattern in PLAIN_NORMS:
        for d in (100, 128, 8192):  # the register-resident kernel (scalar and 16-byte), the two-read one
            x = rand(2, 17, 3, d, dtype=dtype).transpose(1, 2)
            w = rand(d, dtype=dtype)
            got = lib.op(name)(x, w, 1e-6)
            assert got.stride() == x.stride() == pattern(x, w, 1e-6).stride(), (name, d)
            assert torch.equal(got, lib.op(name)(x.contiguous(), w, 1e-6)), (name, d)
            names = kernels_run(lambda: lib.op(name)(x, w, 1e-6))
            assert len(names) == 1 and "rms_norm" in names[0], names
            check(name, pattern, (x, w, 1e-6), dtype)
        torch.library.opcheck(lib.op(name), (x, w, 1e-6))  # the fake impl's strides are the CUDA impl's
    # litgpt's norm too (F.rms_norm's kernels, each layout as eager's ops leave it)
    for d in (100, 128, 8192):
        x = rand(2, 17, 3, d, dtype=dtype).transpose(1, 2)
        w = rand(d, dtype=dtype)
        got = lib.op("litgpt_rms_norm")(x, w, 1e-6)
        assert got.stride() == x.stride() == rmsnorm.litgpt_rmsnorm(x, w, 1e-6).stride(), d
        assert torch.equal(got, lib.op("litgpt_rms_norm")(x.contiguous(), w, 1e-6)), d
        names = kernels_run(lambda: lib.op("litgpt_rms_norm")(x, w, 1e-6))
        assert len(names) == 1 and "rms_norm_torch" in names[0], names
        check("litgpt_rms_norm", rmsnorm.litgpt_rmsnorm, (x, w, 1e-6), dtype)
    torch.library.opcheck(lib.op("litgpt_rms_norm"), (x, w, 1e-6))
    # aten.rms_norm's result is contiguous, and so is the op's for it
    x = rand(2, 17, 3, 128, dtype=dtype).transpose(1, 2)
    w = rand(128, dtype=dtype)
    got = lib.op("torch_rms_norm")(x, w, 128, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, [128], w, 1e-6), rtol=EAGER_TOL[dtype][0],
                               atol=EAGER_TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_softmax_on_every_grid_for_every_row_length(dtype):
    # The softmax op launches one of its grids per call (softmax.grid_for); each private op is right
    # on every row length in every dtype, calls the public op never sends it included (the small
    # blocks given rows longer than they hold take the second read with 32 or 64 threads).
    torch.manual_seed(5)
    make = CASES["softmax"][1]
    for name in (softmax.ROWS, softmax.ROWS_32BIT, softmax.ROWS_SHORT, softmax.ROWS_SHORT_32BIT):
        op = getattr(torch.ops.fxkern_lib, name.split("::")[1])
        for rows, d in [(ROWS, d) for d in ROW_LENGTHS] + [(1000, 64), (4096, 512)]:
            check(name, softmax.softmax, make(rows, d, dtype), dtype, op=op)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_two_read_kernel_alone_is_right_for_calls_the_op_never_sends_it(dtype):
    # The private ops are callable like any op, and each tuning is right in every dtype: short and odd
    # rows, shifted pointers and a weight that is not one row take the kernel's scalar path.
    # (Cohere's op checks its weight is one row, so it takes no other; OLMo 1's has no weight.)
    torch.manual_seed(3)
    for kernel, pattern in TWO_READ_NORMS:
        for tuning in TWO_READ_TABLES[kernel]:
            name = f"_{kernel}_two_read_{tuning.name}"
            op = getattr(torch.ops.fxkern_lib, name)
            for rows, d in ((5, 1), (5, 100), (3, 4097), (4, 8192), (2, 20011)):
                # (x, weight, eps); OLMo 1's norm has no weight: (x, normalized_size, eps)
                x, w, eps = CASES[kernel][1](rows, d, dtype)
                shifted = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)
                weights = (w, rand(rows, d, dtype=dtype)) if "rms_norm" in kernel else (w,)
                for args in [(x, w, eps), (shifted, w, eps)] + [(x, v, eps) for v in weights[1:]]:
                    check(name, pattern, args, dtype, op=op)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_two_read_blocks_striding_over_rows(dtype):
    # The library launches one block a row; the kernel also takes any grid, each block striding over
    # rows and alternating its two reduction slots: 1, 3 and 7 blocks over 10 rows.
    torch.manual_seed(5)
    size = torch.empty((), dtype=dtype).element_size()
    for name, base in (("rms_norm", rmsnorm.RMS_NORM), ("cohere_layer_norm", layernorm.COHERE_LAYER_NORM),
                       ("olmo_layer_norm", layernorm.OLMO_LAYER_NORM)):
        for tuning, blocks in itertools.product((t for t in TWO_READ_TABLES[name] if t.element_size == size), (1, 3, 7)):
            spec = dataclasses.replace(
                base, kernel_name=f"{base.kernel_name}_two_read", kernel_source=tuning.macros() + base.kernel_source,
                geometry=fxkern.Custom(lambda inputs, outputs, b=blocks, t=tuning: ((b,), (t.threads,))))
            op = fxkern.cuda_kernel_op(f"fxkern_test::{name}_two_read_{tuning.name}_{str(dtype)[6:]}_{blocks}_blocks",
                                       spec)
            pattern, make = CASES[name]
            for d in (6144, 8192, 12288, 24576, 100):  # the vector path (rows ending mid-step too), the scalar path
                check(f"{name} two-read kernel {tuning.name}, {blocks} blocks", pattern, make(10, d, dtype), dtype, op=op)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", sorted(CASES))
def test_misaligned_and_strided_inputs(name, dtype):
    pattern, make = CASES[name]
    torch.manual_seed(1)
    for d in (64, 1024, 4096):
        args = make(6, d, dtype)
        # Contiguous but 2 bytes past a 16-byte boundary: the scalar path.
        shifted = tuple(
            torch.cat([a.new_zeros(1), a.flatten()])[1:].view(a.shape) if isinstance(a, torch.Tensor) else a
            for a in args
        )
        assert shifted[0].data_ptr() % 16 != 0
        check(name, pattern, shifted, dtype)
        # Strided views (every other row): the op makes them contiguous first.
        strided = tuple(
            torch.stack([a, a]).transpose(0, 1).reshape(-1, *a.shape[1:])[::2] if isinstance(a, torch.Tensor) and a.dim() == 2 else a
            for a in args
        )
        assert not strided[0].is_contiguous()
        check(name, pattern, strided, dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_empty_input(name):
    pattern, make = CASES[name]
    for rows, d in ((0, 64), (0, 4097), (3, 0)):
        args = make(rows, d, torch.float32)
        for out, want in zip(outputs(lib.op(name)(*args)), outputs(pattern(*args))):
            assert out.shape == want.shape and out.numel() == 0


def test_rank_three_and_broadcast_residual():
    torch.manual_seed(2)
    x, b, r = rand(2, 3, 1000, dtype=torch.bfloat16), rand(1000, dtype=torch.bfloat16), rand(1000, dtype=torch.bfloat16)
    check("bias_gelu_residual", gelu.bias_gelu_residual, (x, b, r), torch.bfloat16)
    check("rms_norm", rmsnorm.llama_rmsnorm, (x, rand(1000, dtype=torch.bfloat16), 1e-5), torch.bfloat16)
    w = rand(1000, dtype=torch.bfloat16)
    check("add_rms_norm", rmsnorm.add_llama_rmsnorm, (x, rand(2, 3, 1000, dtype=torch.bfloat16), w, 1e-5),
          torch.bfloat16)
    # A residual the op broadcasts (x + bias, then the norm), called directly: read modulo its size.
    check("add_rms_norm", rmsnorm.add_llama_rmsnorm, (x, r, w, 1e-5), torch.bfloat16)
    with pytest.raises(fxkern.KernelInputError, match="residual"):
        lib.op("add_rms_norm")(x, rand(3, 1, 1000, dtype=torch.bfloat16), w, 1e-5)


def test_special_values_follow_pytorch():
    x = torch.tensor([[0.0, float("-inf"), 1.0, 2.0], [float("-inf")] * 4, [float("nan"), 1.0, 2.0, 3.0]], device="cuda")
    torch.testing.assert_close(lib.op("softmax")(x), softmax.softmax(x), equal_nan=True)
    big = torch.full((3, 4096), 60000.0, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(lib.op("softmax")(big), softmax.softmax(big))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("d", [64, 512, 1001, 1536, 2048, 4001, 4096, 20000])
def test_softmax_rows_with_special_values_on_every_grid(dtype, d):
    """A NaN anywhere in a row makes the row NaN, as eager's does, though the max skips it (fmaxf, and
    __hmax2 for 16-bit rows: FXK_PAIR_MAX); +inf makes the row NaN, -inf and finfo.min elements weigh
    nothing, a row all -inf is NaN, one all finfo.min uniform. Each row length reaches another grid
    (small blocks, the masked ops' 4-pack ones with their two reductions, the 16384-element one, and
    at 20000 the long rows' online pass, which once lost a NaN that came before any other value), in
    the plain softmax, the scaled, masked one and the soft-capped one (a mask of zeros)."""
    torch.manual_seed(12)
    lo = torch.finfo(dtype).min
    x = rand(10, d, dtype=dtype, scale=3.0)
    x[1, d // 3] = float("nan")
    x[2, d - 1] = float("inf")
    x[3, ::5] = float("-inf")
    x[4, :] = float("-inf")
    x[5, :] = lo
    x[6, ::2] = lo
    x[7, 0], x[7, d // 2] = float("nan"), float("-inf")
    x[8, :64] = float("nan")  # every thread's first pack NaN before any number
    x[9, : d // 2] = float("-inf")
    want = softmax.softmax(x)
    assert want[1].isnan().all() and want[2].isnan().all() and want[4].isnan().all() and want[8].isnan().all()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(lib.op("softmax")(x), want, rtol=rtol, atol=atol, equal_nan=True)
    x4, zeros = x.view(2, 5, 1, d), torch.zeros(1, 1, 1, d, device="cuda", dtype=dtype)
    got = lib.op("scaled_masked_softmax")(x4, zeros, 1.0)
    torch.testing.assert_close(got.view(10, d), want, rtol=rtol, atol=atol, equal_nan=True)
    got = lib.op("softcapped_masked_softmax")(x4, zeros, 1.0, 50.0)  # the cap takes +inf to 50
    torch.testing.assert_close(got, softmax.softcapped_masked_softmax(x4, zeros, 1.0, 50.0), rtol=rtol, atol=atol,
                               equal_nan=True)


ACTIVATIONS = ["bias_gelu", "bias_gelu_tanh", "bias_gelu_residual", "gelu_new", "megatron_bias_gelu", "megatron_gelu", "quick_gelu", "swiglu",
               "geglu", "geglu_tanh", "geglu_new", "geglu_chunked", "clamped_swiglu"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations_at_extreme_inputs_follow_pytorch(name, dtype):
    """The activations' exp and reciprocal flush subnormals (cuda_common's exp_sfu, rcp_sfu): at
    magnitudes where exp over- or underflows, at infinities and NaN, the kernels give what the
    pattern gives in float32 (NaN where it is NaN, the same infinities, and values within the
    dtype's tolerance), on the vector path (with and without a ragged end) and on the scalar one (x one
    element past 16-byte alignment)."""
    pattern, make = CASES[name]
    big = torch.finfo(dtype).max
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 9.0, -9.0, 13.3, -13.3, 14.5, -14.5, 44.0, -44.0,
                           89.0, -89.0, 300.0, -300.0, big, -big, float("inf"), float("-inf"), float("nan"), 0.5],
                          device="cuda")
    for d in (24, 23):  # whole 16-byte packs, and not
        args = list(make(4, d, dtype))
        x = args[0].view(4, -1)
        x[:2, :] = values[torch.arange(x.shape[1], device="cuda") % values.numel()].to(dtype)  # finite in dtype or +-inf
        x[2:, :] = x[:2, :].flip(-1)
        shifted = torch.cat([x.new_zeros(1), args[0].flatten()])[1:].view(args[0].shape)
        for where, call in ((f"d={d}", args), (f"d={d} shifted", [shifted, *args[1:]])):
            poison()
            got = lib.op(name)(*call)
            ref = pattern(*upcast(call, torch.float32)).to(dtype)
            assert torch.equal(got.isnan(), ref.isnan()), f"{name} {dtype} {where}: NaN where PyTorch has none, or not"
            rtol, atol = TOL[dtype]
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"{name} {dtype} {where}: {m}")


def test_float32_bias_gelu_residual_adds_the_residual_as_eager_does():
    """gelu(x + b) + r adds the residual to the rounded GELU, as eager's two ops do: contracted into the
    GELU's last product, a fifth of float32 outputs were a unit in the last place off (a review's probe,
    H100, 2026-11-26). The erf GELU alone is eager's to the bit, and so is the sum now."""
    torch.manual_seed(12)
    x, b, r = rand(2048, 1024, dtype=torch.float32, scale=2.0), rand(1024, dtype=torch.float32), rand(
        2048, 1024, dtype=torch.float32)
    torch.testing.assert_close(lib.op("bias_gelu")(x, b), torch.nn.functional.gelu(x + b), rtol=0, atol=0)
    torch.testing.assert_close(lib.op("bias_gelu_residual")(x, b, r), torch.nn.functional.gelu(x + b) + r,
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("keys", [512, 4096, 20000])
def test_softmax_of_causally_masked_scores(dtype, keys):
    """Attention masks add finfo(dtype).min, so most of a row sits at the most negative finite value;
    whole chunks of a row are masked. The result must be finite and equal PyTorch's."""
    torch.manual_seed(3)
    s = 64
    scores = torch.randn(2, 4, s, keys, device="cuda", dtype=dtype)
    mask = torch.full((s, keys), torch.finfo(dtype).min, device="cuda", dtype=dtype).triu(1)
    x = scores + mask
    got, want = lib.op("softmax")(x), softmax.softmax_float32(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)


# Attention's scores (batch 2, heads 3, q queries, d keys): short rows for each small-block grid, odd
# ones for the EDGES kernels (and the scalar path, run by the other grids), and rows long enough for
# the second read.
MASKED_SIZES = ((5, 1), (5, 7), (4, 32), (3, 100), (64, 64), (6, 1023), (4, 1024), (2, 1536), (3, 2048), (2, 4097), (2, 8200),
                (1, 20011))


def masks_for(q, d, dtype):
    """The masks attention adds, each with every third key and one whole query row at finfo.min:
    transformers' causal (1, 1, q, d) and per-batch (2, 1, q, d), per-head (2, 3, q, d), BERT's
    padding (2, 1, 1, d), and per-head ones shared by the batch, (1, 3, 1, d) and T5's position
    bias (1, 3, q, d) (the kernel visits the rows of these in (h, q, b) order)."""
    for shape in ((1, 1, q, d), (2, 1, q, d), (2, 3, q, d), (2, 1, 1, d), (1, 3, 1, d), (1, 3, q, d)):
        mask = rand(*shape, dtype=dtype, scale=2.0)
        mask[..., ::3] = torch.finfo(dtype).min
        mask[0, 0, 0, :] = torch.finfo(dtype).min
        yield mask


def check_masked(got, want, where):
    """The kernel rounds the scaled and masked scores as eager does, so it is compared with eager at
    the plain softmax's tolerances (a unit in the last place), NaN where eager has NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    rtol, atol = TOL[got.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scaled_masked_softmax_on_every_grid_and_mask(dtype):
    torch.manual_seed(6)
    grids = {s: getattr(torch.ops.fxkern_lib, (softmax.MASKED_ROWS + s).split("::")[1]) for s in softmax.SCALED_MASKED_GRIDS}
    public, divided = lib.op("scaled_masked_softmax"), lib.op("divided_masked_softmax")
    for q, d in MASKED_SIZES:
        x = rand(2, 3, q, d, dtype=dtype, scale=8.0)
        for mask in masks_for(q, d, dtype):
            want = softmax.scaled_masked_softmax(x, mask, 0.125)
            for name, op in [*grids.items(), ("public", public)]:
                poison()
                check_masked(op(x, mask, 0.125), want, f"{name} {dtype} x{tuple(x.shape)} mask{tuple(mask.shape)}")
            poison()
            check_masked(divided(x, mask, 11.0), softmax.divided_masked_softmax(x, mask, 11.0),
                         f"divided {dtype} x{tuple(x.shape)} mask{tuple(mask.shape)}")
            if dtype == torch.float32:
                exact = softmax.scaled_masked_softmax(x.double(), mask.double(), 0.125)
                rel = float((public(x, mask, 0.125).double() - exact).norm() / exact.norm())
                assert rel < 1e-5, f"x{tuple(x.shape)} mask{tuple(mask.shape)}: rel. error vs float64 {rel:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sink_softmax_on_every_grid_and_mask(dtype):
    """GPT-OSS's attention with sinks, on every grid the masked op runs (rows held in registers, long
    rows read three times) and every mask shape, against eager's pattern at the masked ops' tolerances
    (the kernel rounds the scores and their difference from the row's max as eager does), and against
    float64 in float32. Sinks from below the scores to far above them (rows all but given to the sink)."""
    torch.manual_seed(12)
    grids = {s: getattr(torch.ops.fxkern_lib, (softmax.SINK_ROWS + s).split("::")[1]) for s in softmax.SINK_MASKED_GRIDS}
    public = lib.op("sink_masked_softmax")
    for q, d in MASKED_SIZES + ((1, 32768),):
        x = rand(2, 3, q, d, dtype=dtype, scale=8.0)
        sinks = torch.tensor([-3.0, 0.5, 40.0], device="cuda").to(dtype)
        for mask in masks_for(q, d, dtype):
            args = (x, mask, sinks, 0.125, 2, q)
            where = f"{dtype} x{tuple(x.shape)} mask{tuple(mask.shape)}"
            want = softmax.sink_masked_softmax(*args)
            for name, op in [*grids.items(), ("public", public)]:
                poison()
                check_masked(op(*args), want, f"{name} {where}")
            if dtype == torch.float32:
                exact = softmax.sink_masked_softmax(x.double(), mask.double(), sinks.double(), 0.125, 2, q)
                # (a row of one masked key is all sink: zeros)
                rel = float((public(*args).double() - exact).norm() / exact.norm().clamp_min(1e-30))
                assert rel < 1e-5, f"{where}: rel. error vs float64 {rel:.2e}"
    x, mask = rand(2, 3, 64, 512, dtype=dtype), rand(2, 1, 64, 512, dtype=dtype)
    names = kernels_run(lambda: public(x, mask, sinks, 0.125, 2, 64))
    assert len(names) == 1 and "sink_masked_softmax" in names[0], names


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_unscaled_masked_softmax_on_every_mask_and_t5s_position_bias(dtype):
    """T5's unscaled scores plus a mask: the scaled op's grids at a scale of 1 (exact), on every row
    length and mask shape, against eager's plain form and T5's float32 form (``scores + bias``, a
    float32 softmax cast back: the same numbers), and against float64 in float32. T5's position bias
    reaches it as the relative-attention embedding's output permuted to (1, H, q, k), its last axis
    at stride H: the op copies it to a contiguous mask first."""
    torch.manual_seed(10)
    op = lib.op("masked_softmax")
    for q, d in MASKED_SIZES:
        x = rand(2, 3, q, d, dtype=dtype, scale=8.0)
        for mask in masks_for(q, d, dtype):
            where = f"masked_softmax {dtype} x{tuple(x.shape)} mask{tuple(mask.shape)}"
            poison()
            got = op(x, mask)
            check_masked(got, softmax.masked_softmax(x, mask), where)
            check_masked(got, softmax.t5_masked_softmax(x, mask), f"{where} (T5's float32 form)")
            if dtype == torch.float32:
                exact = softmax.masked_softmax(x.double(), mask.double())
                rel = float((got.double() - exact).nan_to_num().norm() / exact.nan_to_num().norm())
                assert rel < 1e-5, f"{where}: rel. error vs float64 {rel:.2e}"
        bias = rand(q, d, 3, dtype=dtype, scale=2.0).permute(2, 0, 1).unsqueeze(0)
        assert bias.stride(-1) == 3
        poison()
        check_masked(op(x, bias), softmax.masked_softmax(x, bias), f"position bias {dtype} x{tuple(x.shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_masked_softmax_blocks_of_several_rows_end_on_an_odd_row(dtype):
    """Blocks that take two rows one after another (MASKED_TUNING's steps) leave the last block one row
    when the rows are odd in number: that row must still come out right."""
    torch.manual_seed(7)
    for base, grids, scalars in ((softmax.MASKED_ROWS, softmax.SCALED_MASKED_GRIDS, (0.125,)),
                                 (softmax.SOFTCAPPED_ROWS, softmax.SOFTCAPPED_MASKED_GRIDS, (0.125, 50.0))):
        reference = softmax.scaled_masked_softmax if base == softmax.MASKED_ROWS else softmax.softcapped_masked_softmax
        for q, d in ((1, 2048), (3, 1100), (5, 2048), (1, 512), (7, 1024)):
            x = rand(1, 1, q, d, dtype=dtype, scale=8.0)
            mask = rand(1, 1, q, d, dtype=dtype, scale=2.0)
            mask[..., ::3] = torch.finfo(dtype).min
            want = reference(x, mask, *scalars)
            for suffix in grids:
                poison()
                got = getattr(torch.ops.fxkern_lib, (base + suffix).split("::")[1])(x, mask, *scalars)
                check_masked(got, want, f"{base}{suffix} {dtype} x{tuple(x.shape)}")


# (scale, cap, spread of the scores): Gemma 2 9B's kind, a scale and cap that are bfloat16 numbers
# (the bfloat16 kernels multiply them in pairs), and 27B's 1 / sqrt(144), which is not (the float
# path); the spread puts scores * scale / cap over tanh's curve.
SOFTCAPS = [(0.5, 5.0, 8.0), (1 / 12, 50.0, 600.0)]


@pytest.mark.parametrize("scale,cap,spread", SOFTCAPS, ids=["16-bit scale and cap", "float32 scale"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_softcapped_masked_softmax_on_every_grid_and_mask(dtype, scale, cap, spread):
    """Gemma 2's soft-capped scores, each step rounded as eager rounds it, so held to the plain
    softmax's tolerances against eager. (bfloat16's tanh.approx.f32, rounded, is eager's tanhf
    rounded for every bfloat16 input: tools/tanh_bf16.py.)"""
    torch.manual_seed(9)
    grids = {s: getattr(torch.ops.fxkern_lib, (softmax.SOFTCAPPED_ROWS + s).split("::")[1])
             for s in softmax.SOFTCAPPED_MASKED_GRIDS}
    public = lib.op("softcapped_masked_softmax")
    for q, d in MASKED_SIZES:
        x = rand(2, 3, q, d, dtype=dtype, scale=spread)
        for mask in masks_for(q, d, dtype):
            want = softmax.softcapped_masked_softmax(x, mask, scale, cap)
            exact = softmax.softcapped_masked_softmax(x.double(), mask.double(), scale, cap)
            for name, op in [*grids.items(), ("public", public)]:
                where = f"{name} {dtype} x{tuple(x.shape)} mask{tuple(mask.shape)}"
                poison()
                got = op(x, mask, scale, cap)
                check_masked(got, want, where)
                if dtype == torch.bfloat16:  # and as close to the exact softmax as eager is
                    live = ~want.isnan()
                    err, eager_err = ((t.double() - exact)[live].abs() for t in (got, want))
                    assert err.max() <= 2 * eager_err.max() + 1e-6, f"{where}: max error {err.max():.2e}, eager's {eager_err.max():.2e}"
                    assert err.norm() <= 1.25 * eager_err.norm() + 1e-6, f"{where}: error norm {err.norm():.2e}, eager's {eager_err.norm():.2e}"
            if dtype == torch.float32:
                rel = float((public(x, mask, scale, cap).double() - exact).nan_to_num().norm() / exact.nan_to_num().norm())
                assert rel < 1e-5, f"x{tuple(x.shape)} mask{tuple(mask.shape)}: rel. error vs float64 {rel:.2e}"


def off_boundary(t: torch.Tensor, elements: int) -> torch.Tensor:
    """``t``'s values in a contiguous tensor ``elements`` past a 16-byte boundary."""
    flat = torch.cat([t.new_zeros(elements), t.flatten()])
    return flat[elements:].view(t.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rows_not_in_whole_packs_on_every_edges_kernel(dtype):
    """Rows of an odd length (a prompt of 1001 tokens) and masks off a 16-byte boundary run in the EDGES
    kernels, which read a row in the aligned packs around it: its first and last packs hold the rows
    beside it, which must count for nothing and not be written, and the mask's packs are shifted to the
    scores' phase in registers. Every EDGES grid of the scaled, soft-capped, sink and plain softmax, on
    rows each grid holds and ones it does not (the scalar path then), every phase of a row's start
    (consecutive rows of an odd length) and of the mask's, against eager; and the public ops, which pick
    them (poisoned memory shows an element left unwritten; a write into a neighbour's elements shows
    where it lands after the neighbour's own)."""
    torch.manual_seed(28)
    pack = 16 // torch.empty((), dtype=dtype).element_size()
    ops = torch.ops.fxkern_lib

    def edges(base, grids):
        return {s: getattr(ops, (base + s).split("::")[1]) for s in grids if s.endswith(softmax.EDGES)}

    masked, capped = edges(softmax.MASKED_ROWS, softmax.SCALED_MASKED_GRIDS), edges(softmax.SOFTCAPPED_ROWS,
                                                                                    softmax.SOFTCAPPED_MASKED_GRIDS)
    sink, plain = edges(softmax.SINK_ROWS, softmax.SINK_MASKED_GRIDS), edges(softmax.ROWS, softmax.SOFTMAX_GRIDS)
    assert masked and capped and sink and plain
    sinks = torch.tensor([-3.0, 0.5, 40.0], device="cuda").to(dtype)
    for q, d in ((3, 5), (5, pack + 1), (7, 77), (5, 1001), (3, 1024 - pack + 1), (3, 2048 - pack + 1), (2, 4001),
                 (2, 1024)):
        x = rand(2, 3, q, d, dtype=dtype, scale=8.0)
        x[1, 2, -1, :] = float("nan")  # a NaN row beside others: theirs stay numbers
        x[0, 1, 0, ::7] = float("-inf")
        for mask in (*masks_for(q, d, dtype), off_boundary(rand(2, 1, q, d, dtype=dtype, scale=2.0), 1),
                     off_boundary(rand(1, 3, 1, d, dtype=dtype, scale=2.0), pack - 1)):
            where = f"{dtype} x{tuple(x.shape)} mask{tuple(mask.shape)} at {mask.data_ptr() % 16}"
            for name, reference, ops_, scalars in (
                    ("scaled", softmax.scaled_masked_softmax, {**masked, "public": lib.op("scaled_masked_softmax")},
                     (0.125,)),
                    ("soft-capped", softmax.softcapped_masked_softmax,
                     {**capped, "public": lib.op("softcapped_masked_softmax")}, (0.125, 50.0)),
                    ("sink", softmax.sink_masked_softmax, {**sink, "public": lib.op("sink_masked_softmax")},
                     (sinks, 0.125, 2, q))):
                args = (x, mask, *scalars)
                want = reference(*args)
                for suffix, op in ops_.items():
                    poison()
                    check_masked(op(*args), want, f"{name}{suffix} {where}")
        want = softmax.softmax(x)
        for suffix, op in {**plain, "public": lib.op("softmax")}.items():
            poison()
            check_masked(op(x), want, f"softmax{suffix} {dtype} x{tuple(x.shape)}")
        # scores off a 16-byte boundary: their output does not share their phase, so the scalar path
        shifted = off_boundary(x, 1)
        mask = next(masks_for(q, d, dtype))
        check_masked(lib.op("scaled_masked_softmax")(shifted, mask, 0.125),
                     softmax.scaled_masked_softmax(x, mask, 0.125), f"shifted scores {dtype} x{tuple(x.shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scaled_masked_softmax_reads_expanded_and_strided_masks(dtype):
    """transformers expands its causal mask over the batch (stride 0): the op reads it in place, one
    mask row for every batch; a sliced mask (a longer cache's) is copied first. Both are right."""
    torch.manual_seed(7)
    x = rand(4, 8, 128, 128, dtype=dtype, scale=8.0)
    base = torch.full((128, 160), torch.finfo(dtype).min, device="cuda", dtype=dtype).triu(1)
    expanded = base[None, None, :, :128].expand(4, 1, 128, 128)
    op = lib.op("scaled_masked_softmax")
    for mask in (expanded, base[None, None, :, :128], expanded.contiguous()):
        check_masked(op(x, mask, 0.125), softmax.scaled_masked_softmax(x, mask, 0.125), f"{dtype} {mask.stride()}")
    compact = base[None, None].expand(4, 1, 128, 160).contiguous()[..., :128].expand(4, 8, 128, 128)
    check_masked(op(x, compact, 0.125), softmax.scaled_masked_softmax(x, compact, 0.125), f"{dtype} sliced")


def test_float32_masked_scores_are_rounded_twice_as_eager_rounds_them():
    """x * scale, rounded, then + mask, rounded (eager's two ops), not one fma: at scores in the
    thousands times Llama's 1 / sqrt(128) (not a power of two), the fma's single rounding moved the
    softmax by up to 3.7e-5 (H100), over the float32 tolerance (found by a review, 2026-11-26)."""
    torch.manual_seed(9)
    grids = {s: getattr(torch.ops.fxkern_lib, (softmax.MASKED_ROWS + s).split("::")[1]) for s in softmax.SCALED_MASKED_GRIDS}
    public, divided = lib.op("scaled_masked_softmax"), lib.op("divided_masked_softmax")
    scale = 128 ** -0.5
    for q, d in ((4, 64), (4, 1024), (3, 2048), (2, 8200), (1, 20011)):
        x = rand(2, 3, q, d, dtype=torch.float32, scale=4.0) + 30000.0
        mask = rand(1, 1, q, d, dtype=torch.float32)
        want = softmax.scaled_masked_softmax(x, mask, scale)
        for name, op in [*grids.items(), ("public", public)]:
            check_masked(op(x, mask, scale), want, f"{name} x{tuple(x.shape)}")
        check_masked(divided(x, mask, 11.0), softmax.divided_masked_softmax(x, mask, 11.0), f"divided x{tuple(x.shape)}")


def test_divided_masked_softmax_by_zero_follows_pytorch():
    """x / 0.0 is inf, -inf or NaN in eager; the op multiplies by the reciprocal, inf, as PyTorch's
    CUDA division does (it raised ZeroDivisionError in Python before)."""
    x = rand(1, 2, 4, 64, dtype=torch.float32)
    mask = torch.zeros(1, 1, 4, 64, device="cuda")
    for divisor in (0.0, -0.0):
        check_masked(lib.op("divided_masked_softmax")(x, mask, divisor),
                     softmax.divided_masked_softmax(x, mask, divisor), f"divisor {divisor}")


# One row of 2^31 - 8 elements, the most a call may have in 16-byte packs of float16: a thread's
# column in the long-row loops passed 2^31 and, as an int, wrapped below zero (found by a review,
# 2026-11-26); the loops count in 64 bits now (signed: the compiler still unrolls them).
LONGEST_ROW = (2**31 - 1) // 8 * 8


def test_softmax_of_one_row_of_2_31_elements():
    """Finite scores at both ends of the row, -inf between: the output is their softmax there and 0
    everywhere else (a column that wrapped would read or write outside the row)."""
    torch.manual_seed(10)
    x = torch.full((1, LONGEST_ROW), float("-inf"), device="cuda", dtype=torch.float16)
    at = torch.cat((torch.arange(0, 4096, 3), torch.arange(LONGEST_ROW - 8192, LONGEST_ROW, 5))).cuda()
    x[0, at] = rand(at.numel(), dtype=torch.float16, scale=4.0)
    y = lib.op("softmax")(x)
    got = y[0, at].clone()
    y[0, at] = 0
    assert not y.any()
    torch.testing.assert_close(got, torch.softmax(x[0, at].float(), -1).half(), rtol=2e-3, atol=2e-3)
    del x, y
    torch.cuda.empty_cache()


def test_add_rms_norm_of_one_row_of_2_31_elements():
    """The residual add and norm's long-row loops. x and the residual are random signs, so every
    thread's float32 sum of squares is exact (an integer under 2^26, a multiple of 4) and the row's
    mean square is 2 within rounding: y is weight * (h * rsqrt(2 + eps)) element by element."""
    torch.manual_seed(11)
    x, res = ((torch.randint(0, 2, (1, LONGEST_ROW), device="cuda", dtype=torch.int8) * 2 - 1).half()
              for _ in range(2))
    w = rand(LONGEST_ROW, dtype=torch.float16)
    y, h = lib.op("add_rms_norm")(x, res, w, 1e-6)
    ss = 0.0
    chunks = [slice(i, i + (1 << 28)) for i in range(0, LONGEST_ROW, 1 << 28)]
    for c in chunks:
        hc = x[0, c] + res[0, c]
        assert torch.equal(h[0, c], hc), c
        ss += float(hc.float().pow(2).sum())
    r = torch.rsqrt(torch.tensor(ss / LONGEST_ROW + 1e-6, device="cuda"))
    for c in chunks:
        want = w[c] * (h[0, c].float() * r).half()
        torch.testing.assert_close(y[0, c], want, rtol=1e-3, atol=1e-3, msg=lambda m: f"{c}: {m}")
    del x, res, w, y, h
    torch.cuda.empty_cache()


def test_add_layer_norm_of_one_row_of_2_31_elements():
    """add_layer_norm's long-row loops count columns in 64 bits (they wrapped below zero past 2^31).
    h = x + residual is 0 or +-2 (random signs), so its mean and variance are exact sums of integers,
    computed here chunk by chunk in float64."""
    torch.manual_seed(12)
    n = LONGEST_ROW
    x, res = ((torch.randint(0, 2, (1, n), device="cuda", dtype=torch.int8) * 2 - 1).half() for _ in range(2))
    w, b = rand(n, dtype=torch.float16), rand(n, dtype=torch.float16)
    y, h = lib.op("add_layer_norm")(x, res, w, b, n, 1e-5)
    chunks = [slice(i, i + (1 << 28)) for i in range(0, n, 1 << 28)]
    total = squares = 0.0
    for c in chunks:
        hc = x[0, c] + res[0, c]
        assert torch.equal(h[0, c], hc), c
        total += float(hc.double().sum())
        squares += float(hc.double().pow(2).sum())
    mean = total / n
    rstd = (squares / n - mean * mean + 1e-5) ** -0.5
    for c in chunks:
        want = ((h[0, c].double() - mean) * rstd * w[c].double() + b[c].double()).half()
        torch.testing.assert_close(y[0, c], want, rtol=2e-3, atol=2e-3, msg=lambda m: f"{c}: {m}")
    del x, res, w, b, y, h
    torch.cuda.empty_cache()


def _causal_scores(tokens, dtype, batch=1, scalars=(0.125,)):
    """Eager attention's scores (32 heads) and causal mask (b, 1, q, k); 2^31 elements a batch index at
    8192 tokens."""
    mask = torch.full((tokens, tokens), torch.finfo(dtype).min, device="cuda", dtype=dtype).triu(1)
    return rand(batch, 32, tokens, tokens, dtype=dtype, scale=4.0), mask.expand(batch, 1, tokens, tokens).contiguous(), *scalars


def _queries(seq, dtype, transposed=False, tables=None):
    """Queries (1, 32, seq, 128) and their tables (of ``tables`` dtype, else the queries'); ``transposed``:
    attention's (B, S, H, D) projection viewed (B, H, S, D), the layout Llama's rotation reads."""
    q = rand(1, seq, 32, 128, dtype=dtype).transpose(1, 2) if transposed else rand(1, 32, seq, 128, dtype=dtype)
    return (q, *rope_tables(1, seq, 128, tables or dtype), 64)


# Calls with outputs of 2^31 elements or more, past the kernels' 32-bit indexing, that eager PyTorch
# runs, each made by its function with big=True (the reference cases also make a small call of the same
# op with big=False). Ops whose outputs are independent along every axis but the last run in pieces
# within the limits (``past_limits="split"``): attention's scores (a derived launch behind an eager_fn;
# at batch 1 cut along the heads, at batch 2 into one batch index and 16 heads a piece), an MLP's
# activations (a derived launch alone), a norm's rows (an eager_fn picking a kernel). The others run
# their reference: the queries' rotation (an eager_fn that refuses the size
# itself; OLMo's, against float32 tables, on attention's transposed view, whose result keeps that layout
# as eager's does) and the keys' repeat (an input of 2^29 elements, its output four times that). One op a
# case: each logs once a process.
PAST_INT32_SPLIT = {  # name: (the call; the pieces and the axis a call past the limits is cut in)
    "scaled_masked_softmax": (lambda dtype: _causal_scores(8192, dtype), (2, 1)),
    "swiglu": (lambda dtype: (rand(1 << 18, 8192, dtype=dtype), rand(1 << 18, 8192, dtype=dtype)), (2, 0)),
    "rms_norm": (lambda dtype: (rand(1 << 18, 8192, dtype=dtype), rand(8192, dtype=dtype), 1e-6), (2, 0)),
    # batch 2: one batch index is 2^31 elements itself, so each piece is one batch index and 16 heads
    "softcapped_masked_softmax": (lambda dtype: _causal_scores(8192, dtype, batch=2, scalars=(0.0625, 50.0)), (4, 1)),
}
PAST_INT32 = {
    "rotary_embedding": lambda big, dtype: _queries(1 << 19 if big else 64, dtype),
    "rotary_embedding_float32_tables": lambda big, dtype: _queries(1 << 19 if big else 64, dtype, transposed=True,
                                                                  tables=torch.float32),
    "repeat_kv": lambda big, dtype: (rand(1, 8, 1 << 19 if big else 64, 128, dtype=dtype), 1, 8, 4,
                                     1 << 19 if big else 64, 128, 32),
}


@pytest.mark.parametrize("name", PAST_INT32_SPLIT)
def test_calls_past_int32_run_in_pieces(name, caplog):
    """A call past the kernel's 32-bit sizes runs as calls of the kernel within them: the result is, to
    the bit, the kernel's on each piece (so each piece ran the kernel, and landed in its place), and as
    close to the model's own code as the kernel always is; the reference never runs, nothing warns. A
    repeated call holds no piece's outputs beside the whole call's (each launch writes its part)."""
    torch.manual_seed(14)
    dtype = torch.bfloat16
    op, reference = lib.op(name), fxkern.kernel_op(f"fxkern_lib::{name}").reference
    make, (count, axis) = PAST_INT32_SPLIT[name]
    args = make(dtype)
    with caplog.at_level("INFO", logger="fxkern"):
        got = op(*args)
    assert got.numel() >= 2**31 and got.is_contiguous()
    cut = split.plan([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args], [tuple(got.shape)])
    assert (len(cut.pieces), cut.axis) == (count, axis)
    for at, start, length in cut.pieces:
        piece = tuple(split._narrow(a, got.dim(), axis, at, start, length) for a in args)
        part = split._narrow(got, got.dim(), axis, at, start, length)
        assert part.numel() * count == got.numel()
        assert torch.equal(part, op(*piece)), (name, at, start)
        torch.testing.assert_close(part, reference(*piece), rtol=2e-2, atol=2e-2)
    del part, piece
    # called again (its pieces' launches known), it allocates the whole output and no piece's own
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    again = op(*args)
    grew, whole = torch.cuda.max_memory_allocated() - before, again.numel() * again.element_size()
    assert whole <= grew < whole + whole // (2 * count), (name, grew, whole)
    assert torch.equal(again, got)
    del args, got, again
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert f"run as several calls within them (this one as {count} along axis {axis})" in caplog.text
    assert "run the op's reference instead" not in caplog.text


@pytest.mark.parametrize("name", PAST_INT32)
def test_calls_past_int32_run_the_reference(name, caplog):
    """A rewritten model runs every size the original ran: a library op handed more elements than its
    kernel indexes, whose call cannot be cut, runs its pattern (the model's own code) on the GPU and says
    so once; the next call of a size the kernel takes runs the kernel (no sticky error, no second warning)."""
    torch.manual_seed(14)
    dtype = torch.bfloat16
    op, reference = lib.op(name), fxkern.kernel_op(f"fxkern_lib::{name}").reference
    args = PAST_INT32[name](True, dtype)
    with caplog.at_level("WARNING", logger="fxkern"):
        got = op(*args)
        want = reference(*args)
        assert got.numel() == 2**31
        assert torch.equal(got, want), name
        assert got.stride() == want.stride()
        del args, got, want
        torch.cuda.empty_cache()
        small = PAST_INT32[name](False, dtype)
        torch.testing.assert_close(op(*small), reference(*small), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    assert sum("run the op's reference instead" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_torch_rms_norm_forms_compute_f_rms_norms_numbers(dtype):
    """F.rms_norm rounds x * r * weight once; Llama's form rounds the normalised row first, which put a
    quarter of 16-bit outputs an ulp from eager's. The torch forms' kernels (register-resident, two-read,
    add + norm) match F.rms_norm on CUDA in 16-bit but where float32 sums taken in another order move r by
    an ulp. In float32 that ulp of r shows in most of a row's outputs (a quarter of them differed at
    d = 64, H100, 2026-11-26), so float32 is held to a few float32 ulps."""
    F = torch.nn.functional
    torch.manual_seed(13)
    for d in (64, 1000, 4096, 8192):
        x, r = rand(512, d, dtype=dtype), rand(512, d, dtype=dtype)
        w = rand(d, dtype=dtype) * 0.5 + 1
        cases = ((lib.op("torch_rms_norm")(x, w, d, 1e-6), F.rms_norm(x, [d], w, 1e-6)),
                 (lib.op("torch_rms_norm_default_eps")(x, w, d), F.rms_norm(x, [d], w)),
                 (lib.op("add_torch_rms_norm")(x, r, w, d, 1e-6)[0], F.rms_norm(x + r, [d], w, 1e-6)),
                 # litgpt's form rounds once too: the same kernels
                 (lib.op("litgpt_rms_norm")(x, w, 1e-6), F.rms_norm(x, [d], w, 1e-6)),
                 (lib.op("add_litgpt_rms_norm")(x, r, w, 1e-6)[0], F.rms_norm(x + r, [d], w, 1e-6)))
        for k, (got, want) in enumerate(cases):
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"d={d}, form {k}: {m}")
                continue
            differ = float((got != want).float().mean())
            assert differ < 1e-3, (d, k, differ)
            torch.testing.assert_close(got, want, rtol=EAGER_TOL[dtype][0], atol=EAGER_TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scaled_masked_softmax_at_long_rows_of_shared_masks(dtype):
    """Heads sharing a mask are visited in (b, q, h) order (the kernel's MaskedRows), a batch sharing
    a per-head one in (h, q, b) order, the others in memory order; every row must land in its own place (outputs start as NaN), on every grid, with a
    9 MB (float32) or 4.5 MB (16-bit) mask; float32 rows of 1536 take the small blocks' long-row path."""
    torch.manual_seed(8)
    q = 1536  # a (1536, 1536) mask: 9 MB in float32, 4.5 MB in 16-bit
    x = rand(2, 3, q, q, dtype=dtype, scale=8.0)
    for mask in masks_for(q, q, dtype):
        want = softmax.scaled_masked_softmax(x, mask, 0.125)
        poison()
        check_masked(lib.op("scaled_masked_softmax")(x, mask, 0.125), want, f"{dtype} mask{tuple(mask.shape)}")
    grids = {s: getattr(torch.ops.fxkern_lib, (softmax.MASKED_ROWS + s).split("::")[1]) for s in softmax.SCALED_MASKED_GRIDS}
    mask = next(masks_for(q, q, dtype))
    want = softmax.scaled_masked_softmax(x, mask, 0.125)
    for name, op in grids.items():
        poison()
        check_masked(op(x, mask, 0.125), want, f"{name} {dtype}")


def test_rewritten_llama_on_gpu_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 256, (2, 32), device="cuda")
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    new = fxkern.apply(ep, lib.rules())
    targets = {n.target for n in new.graph.nodes}
    assert {lib.op("rms_norm").default, lib.op("add_rms_norm").default, lib.op("swiglu").default,
            lib.op("scaled_masked_softmax").default, lib.op("rotary_embedding").default} <= targets
    other = torch.randint(0, 256, (2, 32), device="cuda")
    with torch.no_grad():
        want = model(other, use_cache=False).logits
        got = new.module()(other, use_cache=False).logits
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_blocks_under_cuda_autocast_and_no_grad_are_rewritten_where_autocast_changes_nothing():
    """torch.export keeps the blocks as higher-order ops over submodules. Inside CUDA autocast the
    Llama RMSNorm upcasts first, so autocast's float32 ops run as written and it is replaced; the
    softmax of bfloat16 scores autocast runs in float32, so that match is refused."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(256, 512)
            self.weight = torch.nn.Parameter(torch.randn(512) * 0.1 + 1)

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = self.lin(x)
                hf = h.to(torch.float32)
                v = hf.pow(2).mean(-1, keepdim=True)
                n = self.weight * (hf * torch.rsqrt(v + 1e-6)).to(h.dtype)
                p = torch.softmax(h, dim=-1)
            with torch.no_grad():
                a, b = n.chunk(2, -1)
                g = torch.nn.functional.silu(a) * b
            return g, p

    torch.manual_seed(0)
    model = Block().cuda().to(torch.bfloat16)
    ep = torch.export.export(model, (rand(64, 256, dtype=torch.bfloat16),))
    report = fxkern.explain(ep, lib.rules())
    assert {m.rule for m in report.matches} == {"rms_norm", "swiglu_chunked"}, str(report)
    assert any("torch.autocast('cuda')" in nm.reason and "softmax" in nm.reason
               for nm in report["softmax"].near_misses), str(report)
    new = fxkern.apply(ep, lib.rules())
    x = rand(64, 256, dtype=torch.bfloat16)
    want, got = model(x), new.module()(x)
    torch.testing.assert_close(got[0], want[0], rtol=5e-2, atol=3e-2)
    assert got[1].dtype == torch.float32
    torch.testing.assert_close(got[1], want[1])


def test_torch_rms_norm_checks_its_row_length_on_cuda():
    x, w = torch.randn(3, 64, device="cuda"), torch.randn(64, device="cuda")
    with pytest.raises(fxkern.KernelInputError, match="normalized_size=32 must be the last axis"):
        lib.op("torch_rms_norm")(x, w, 32, 1e-6)
    with pytest.raises(fxkern.KernelInputError, match="add_torch_rms_norm: normalized_size=32 must be the last axis"):
        lib.op("add_torch_rms_norm")(x, x, w, 32, 1e-6)


def test_weight_and_bias_shapes_a_kernel_cannot_index_are_refused():
    """A full-shape RMSNorm weight is read correctly; a (N, 1) weight or bias would be read
    wrongly by ``w[i % numel(w)]``, so the op refuses it before launch."""
    x = torch.randn(6, 40, device="cuda")
    full = torch.randn(6, 40, device="cuda")
    torch.testing.assert_close(lib.op("rms_norm")(x, full, 1e-6), rmsnorm.llama_rmsnorm(x, full, 1e-6))
    with pytest.raises(fxkern.KernelInputError, match="trailing axes"):
        lib.op("rms_norm")(x, torch.randn(6, 1, device="cuda"), 1e-6)
    with pytest.raises(fxkern.KernelInputError, match="trailing axes"):
        lib.op("bias_gelu")(x, torch.randn(6, 1, device="cuda"))


def test_rewritten_demo_model_replays_in_a_cuda_graph():
    """Every library op launches on torch's current stream and allocates through its allocator, so a
    rewritten model's whole forward captures in a CUDA graph (the cure for a host-bound eager forward)."""
    from fxkern.demo import SIZES, build_model

    cfg = SIZES["small"]
    model = build_model(cfg, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device="cuda")
    rewritten = fxkern.apply(torch.export.export(model, (ids,)), lib.rules()).module()
    with torch.no_grad():
        want = rewritten(ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rewritten(ids)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = rewritten(ids)
        ids.copy_(torch.randint(0, cfg.vocab, ids.shape, device="cuda"))  # replay reads the new tokens
        graph.replay()
        torch.testing.assert_close(out, rewritten(ids), rtol=0, atol=0)
    assert not torch.equal(out, want)


# ---- rotary position embedding: eager's four roundings kept, so equal to the bit ---------------------

# Head sizes: 2 and 6 (no 16-byte pack fits a half), 16 (a float32 pack only), 64 and 128 (the models'),
# 74 (halves of 37: the scalar path), 256.
HEAD_SIZES = (2, 6, 16, 64, 74, 128, 256)


def rope_tables(b, s, d, dtype):
    pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    emb = torch.cat((pos * inv, pos * inv), dim=-1)[None].expand(b, s, d)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (b, 1, s, d), as transformers'


def laid_out_as(got, want) -> bool:
    """got has want's strides on every axis of more than one element (an axis of one has none that matters)."""
    return all(g == w for g, w, n in zip(got.stride(), want.stride(), got.shape) if n > 1)


def bits_equal(got, want, where):
    """got is want to the bit: -0 is not +0 (NaNs, of any payload, are equal)."""
    bits = {4: torch.int32, 2: torch.int16}[got.element_size()]
    same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{where}: {int((~same).sum())} elements differ in their bits"


def same_as_eager(got, want, where):
    """A rotation's result is eager's: its shape, dtype and layout (the projection's (B, S, H, D) memory
    where x is its view, else contiguous), and its values to the bit."""
    assert got.shape == want.shape and got.dtype == want.dtype, where
    assert laid_out_as(got, want), f"{where}: strides {got.stride()}, eager's {want.stride()}"
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    bits_equal(got, want, where)


def check_rope(x, cos, sin, where):
    poison()
    got = lib.op("rotary_embedding")(x, cos, sin, x.shape[-1] // 2)
    same_as_eager(got, rotary.rotary_embedding(x, cos, sin, x.shape[-1] // 2), where)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rotary_embedding_on_every_layout_and_head_size(dtype):
    torch.manual_seed(0)
    b, s, h = 3, 37, 5
    for d in HEAD_SIZES:
        cos, sin = rope_tables(b, s, d, dtype)
        projected = rand(b, s, h * d, dtype=dtype, scale=3.0).view(b, s, h, d).transpose(1, 2)
        layouts = {
            "projected (read in place)": projected,
            "contiguous": projected.contiguous(),
            "rotary part of wider heads (read in place)": rand(b, h, s, d + 8, dtype=dtype)[..., :d],
            "a column block of a fused QKV projection (GPT-NeoX)":
            rand(b, s, h * 3 * d, dtype=dtype).view(b, s, h, 3 * d).transpose(1, 2)[..., d:2 * d],
            "one element past 16-byte alignment": torch.cat([projected.new_zeros(1), projected.contiguous().flatten()])[1:]
            .view(b, h, s, d),
            "projected, one element past alignment": torch.cat([projected.new_zeros(1), rand(b * s * h * d, dtype=dtype)])[1:]
            .view(b, s, h, d).transpose(1, 2),
        }
        tables = {
            "(b, 1, s, d)": (cos, sin),
            "(1, 1, s, d)": (cos[:1], sin[:1]),
            "(b, h, s, d)": (cos.expand(b, h, s, d).contiguous(), sin.expand(b, h, s, d).contiguous()),
            "expanded over the batch": (cos[:1].expand(b, 1, s, d), sin[:1].expand(b, 1, s, d)),
            "cos expanded, sin not": (cos[:1].expand(b, 1, s, d), sin),
            "(1, h, s, d)": (rand(1, h, s, d, dtype=dtype), rand(1, h, s, d, dtype=dtype)),
            "(b, 1, 1, d): one position for all": (cos[:, :, :1], sin[:, :, :1]),
        }
        for lname, x in layouts.items():
            for tname, (c, sn) in tables.items():
                check_rope(x, c, sn, f"{dtype} d={d} x {lname}, cos {tname}")


def special_rows():
    """(2, 2, 4, 16) float32 rows of infinities, NaN, near-overflow, -0 and subnormals of each dtype
    (1e-39: float32 and bfloat16; 3e-5: float16), each row's two halves different, so each special
    value meets ordinary ones (rolled by 3 in the second half of the rows)."""
    vals = [0.0, float("inf"), float("nan"), -3.0e38, 1.0, -1e-39, 3e-5, 0.5, 2.0, -1.5, 0.25, -0.0, float("-inf"),
            7.0, -2e-39, 1e-4]
    x = torch.tensor(vals, device="cuda").repeat(8, 1)
    return torch.cat([x, x.roll(3, dims=1)], 0).view(2, 2, 4, 16)


def test_rotary_embedding_special_values_and_one_position():
    x = special_rows()
    cos, sin = rope_tables(2, 4, 16, torch.float32)
    check_rope(x, cos, sin, "inf, nan, near-overflow")
    for dtype in (torch.float16, torch.bfloat16):
        check_rope(x.to(dtype), cos.to(dtype), sin.to(dtype), f"{dtype} special values")
    one = rand(4, 8, 1, 64, dtype=torch.bfloat16)  # decoding: one position
    c, s = rope_tables(4, 1, 64, torch.bfloat16)
    check_rope(one, c, s, "one position")


def test_rotary_embedding_reads_the_projection_in_place_and_empty_input():
    x = rand(2, 64, 4 * 64, dtype=torch.bfloat16).view(2, 64, 4, 64).transpose(1, 2)
    cos, sin = rope_tables(2, 64, 64, torch.bfloat16)
    names = kernels_run(lambda: lib.op("rotary_embedding")(x, cos, sin, 32))
    assert runs_only(names, "rotary_strided"), names  # one kernel, no copy of x first
    empty = x[:, :, :0]
    out = lib.op("rotary_embedding")(empty, cos[:, :, :0], sin[:, :, :0], 32)
    assert out.shape == empty.shape


def check_float32_tables(x, cos, sin, where):
    poison()
    half = x.shape[-1] // 2
    got = lib.op("rotary_embedding_float32_tables")(x, cos, sin, half)
    same_as_eager(got, rotary.rotary_embedding_float32_tables(x, cos, sin, half), f"float32 tables {where}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rotary_with_float32_tables_on_every_layout_and_head_size(dtype):
    """OLMo's rotation: x of any dtype (float32: the plain op's numbers), float32 cos and sin, the float32
    products and sum rounded once, as eager's promoted ops and ``.to(q_type)``."""
    torch.manual_seed(0)
    b, s, h = 3, 37, 5
    for d in HEAD_SIZES:
        cos, sin = rope_tables(b, s, d, torch.float32)
        layouts = dict(gqa_layouts(b, s, h, d, dtype))
        layouts["one element past 16-byte alignment"] = torch.cat(
            [cos.new_zeros(1).to(dtype), rand(b * h * s * d, dtype=dtype)])[1:].view(b, h, s, d)
        tables = {
            "(b, 1, s, d)": (cos, sin),
            "(1, 1, s, d)": (cos[:1], sin[:1]),
            "(b, h, s, d), random": (rand(b, h, s, d, dtype=torch.float32), rand(b, h, s, d, dtype=torch.float32)),
            "expanded over the batch": (cos[:1].expand(b, 1, s, d), sin[:1].expand(b, 1, s, d)),
        }
        for lname, x in layouts.items():
            for tname, (c, sn) in tables.items():
                check_float32_tables(x, c, sn, f"{dtype} d={d} x {lname}, cos {tname}")


def test_rotary_with_float32_tables_special_values_one_kernel_and_checks():
    x = special_rows()
    cos, sin = rope_tables(2, 4, 16, torch.float32)
    big = torch.full_like(cos, 3.0e38)  # float32 products past the 16-bit range: eager's inf after the cast
    for dtype in (torch.float16, torch.bfloat16):
        check_float32_tables(x.to(dtype), cos, sin, f"{dtype} special values")
        check_float32_tables(x.to(dtype), big, sin, f"{dtype} products past its range")
    q = rand(2, 64, 4 * 64, dtype=torch.bfloat16).view(2, 64, 4, 64).transpose(1, 2)
    cos, sin = rope_tables(2, 64, 64, torch.float32)
    op = lib.op("rotary_embedding_float32_tables")
    names = kernels_run(lambda: op(q, cos, sin, 32))
    assert runs_only(names, "rotary_strided_float32_tables"), names  # one kernel, no copy of q first
    assert op(q[:, :, :0], cos[:, :, :0], sin[:, :, :0], 32).shape == q[:, :, :0].shape
    with pytest.raises(fxkern.KernelInputError, match="float32 cos and sin"):
        op(q, cos.to(torch.bfloat16), sin.to(torch.bfloat16), 32)
    torch.cuda.synchronize()  # no sticky error left behind


# ---- grouped-query attention: keys rotated and repeated, values repeated (copies, equal to the bit) ----


def gqa_layouts(b, s, h, d, dtype):
    """Keys or values (b, h, s, d) as attention makes them, and the layouts a caller may pass."""
    projected = rand(b, s, h * d, dtype=dtype, scale=3.0).view(b, s, h, d).transpose(1, 2)
    fused = rand(b, s, 3 * h * d, dtype=dtype)  # Phi-3's qkv_proj: [q | k | v] along each token's row
    return {
        "projected (read in place)": projected,
        "contiguous": projected.contiguous(),
        "part of wider heads (read in place)": rand(b, h, s, d + 8, dtype=dtype)[..., :d],
        "a slice of a fused QKV projection (Phi-3)": fused[..., h * d:2 * h * d].view(b, s, h, d).transpose(1, 2),
        "projected, one element past alignment": torch.cat([projected.new_zeros(1), rand(b * s * h * d, dtype=dtype)])[1:]
        .view(b, s, h, d).transpose(1, 2),
    }


def same_bits(got, want, where):
    assert got.is_contiguous() and got.shape == want.shape and got.dtype == want.dtype, where
    bits_equal(got, want, where)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_repeat_kv_and_rotated_keys_on_every_layout_and_head_size(dtype):
    torch.manual_seed(0)
    for (b, s, h), d, n_rep in itertools.product(((3, 37, 5), (4, 1, 8)), HEAD_SIZES, (1, 2, 4)):  # s = 1: decoding
        cos, sin = rope_tables(b, s, d, dtype)
        sizes = (b, h, n_rep, s, d, h * n_rep)
        tables = {"(b, 1, s, d)": (cos, sin), "(1, 1, s, d)": (cos[:1], sin[:1]),
                  "(1, h, s, d)": (rand(1, h, s, d, dtype=dtype), rand(1, h, s, d, dtype=dtype))}
        for lname, x in gqa_layouts(b, s, h, d, dtype).items():
            where = f"{dtype} {b}x{h}x{s}x{d} n_rep={n_rep} x {lname}"
            poison()
            same_bits(lib.op("repeat_kv")(x, *sizes), rotary.repeat_kv(x, *sizes), f"repeat_kv {where}")
            for tname, (c, sn) in tables.items():
                poison()
                got = lib.op("rotary_embedding_repeat_kv")(x, c, sn, d // 2, *sizes)
                same_bits(got, rotary.rotary_embedding_repeat_kv(x, c, sn, d // 2, *sizes),
                          f"rotary_embedding_repeat_kv {where}, cos {tname}")


def test_gqa_ops_read_the_projection_in_place_and_check_their_sizes():
    x = rand(2, 64, 4 * 64, dtype=torch.bfloat16).view(2, 64, 4, 64).transpose(1, 2)
    cos, sin = rope_tables(2, 64, 64, torch.bfloat16)
    sizes = (2, 4, 2, 64, 64, 8)
    for run in (lambda: lib.op("rotary_embedding_repeat_kv")(x, cos, sin, 32, *sizes),
                lambda: lib.op("repeat_kv")(x, *sizes)):
        names = kernels_run(run)
        assert runs_only(names, "rotary_strided_repeat"), names  # one kernel, no copy first
    with pytest.raises(fxkern.KernelInputError, match=r"heads = 6 must be kv_heads \* n_rep = 4 \* 2"):
        lib.op("repeat_kv")(x, 2, 4, 2, 64, 64, 6)
    with pytest.raises(fxkern.KernelInputError, match=r"is not \(batch, kv_heads, seq, head_dim\) = \(2, 4, 32, 64\)"):
        lib.op("rotary_embedding_repeat_kv")(x, cos, sin, 32, 2, 4, 2, 32, 64, 8)
    with pytest.raises(fxkern.KernelInputError, match="rotary_embedding_repeat_kv: half = 16"):
        lib.op("rotary_embedding_repeat_kv")(x, cos, sin, 16, *sizes)
    empty = x[:, :, :0]
    assert lib.op("repeat_kv")(empty, 2, 4, 2, 0, 64, 8).shape == (2, 8, 0, 64)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_partial_rotary_on_every_layout_and_split(dtype):
    """GPT-NeoX's and Phi-3's partial rotation: the first rotary_dim columns rotated, the rest copied,
    with and without the keys' repeat; equal to the bit."""
    torch.manual_seed(0)
    b, s, h = 3, 37, 5
    for d, rot in ((128, 32), (128, 96), (128, 128), (64, 16), (74, 36), (80, 32), (16, 8), (6, 2)):
        cos, sin = rope_tables(b, s, rot, dtype)
        for lname, x in gqa_layouts(b, s, h, d, dtype).items():
            where = f"{dtype} d={d} rotary_dim={rot} x {lname}"
            poison()
            got = lib.op("partial_rotary_embedding")(x, cos, sin, rot // 2, rot)
            same_bits(got, rotary.partial_rotary_embedding(x, cos, sin, rot // 2, rot), f"partial {where}")
            sizes = (b, h, 2, s, d, 2 * h)
            poison()
            got = lib.op("partial_rotary_embedding_repeat_kv")(x, cos, sin, rot // 2, rot, *sizes)
            same_bits(got, rotary.partial_rotary_embedding_repeat_kv(x, cos, sin, rot // 2, rot, *sizes),
                      f"partial, repeated {where}")


def test_gpt_neox_queries_are_read_out_of_the_fused_projection():
    b, s, h, d = 2, 64, 4, 128
    qkv = rand(b, s, h * 3 * d, dtype=torch.bfloat16).view(b, s, h, 3 * d).transpose(1, 2)
    q = qkv.chunk(3, dim=-1)[0]
    cos, sin = rope_tables(b, s, 32, torch.bfloat16)
    names = kernels_run(lambda: lib.op("partial_rotary_embedding")(q, cos, sin, 16, 32))
    assert runs_only(names, "rotary_strided"), names  # one kernel: no copy of q first
    torch.cuda.synchronize()


# ---- the interleaved rotary embedding (GPT-J, GLM, Cohere): pairs (2i, 2i + 1), equal to the bit ------


def interleaved_tables(b, s, d, dtype):
    """(b, 1, s, d) cos and sin whose columns come in equal pairs (repeat_interleave, as the models build them)."""
    pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    emb = (pos * inv).repeat_interleave(2, dim=-1)[None].expand(b, s, d)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def check_interleaved(name, x, cos, sin, *scalars, where):
    """The op against its pattern run by eager PyTorch: the same bits, laid out as eager's."""
    poison()
    got = lib.op(name)(x, cos, sin, *scalars)
    same_as_eager(got, getattr(interleaved_rotary, name)(x, cos, sin, *scalars), f"{name} {where}")


# Head sizes: 2 and 6 (no 16-byte pack), 16, 64, 128, 74 (the scalar path: 37 pairs), 256.
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_interleaved_rotary_on_every_layout_and_head_size(dtype):
    torch.manual_seed(0)
    b, s, h = 3, 37, 5
    for d in HEAD_SIZES:
        cos, sin = interleaved_tables(b, s, d, dtype)
        layouts = dict(gqa_layouts(b, s, h, d, dtype))
        layouts["GPT-J's (b, s, h, d) heads"] = rand(b, s, h, d, dtype=dtype, scale=3.0)
        layouts["one element past 16-byte alignment"] = torch.cat(
            [cos.new_zeros(1), rand(b * h * s * d, dtype=dtype)])[1:].view(b, h, s, d)
        for lname, x in layouts.items():
            bs = x.shape[:3]  # GPT-J's tables broadcast over its heads, axis 2: (b, s, 1, d)
            tables = {"(b, 1, s, d)": (cos, sin), "(1, 1, s, d)": (cos[:1], sin[:1])}
            if lname.startswith("GPT-J"):
                tables = {"(b, s, 1, d)": (cos.transpose(1, 2), sin.transpose(1, 2))}
            tables["as x, random"] = (rand(*bs, d, dtype=dtype), rand(*bs, d, dtype=dtype))  # pairs unequal too
            for tname, (c, sn) in tables.items():
                where = f"{dtype} d={d} x {lname}, cos {tname}"
                check_interleaved("interleaved_rotary_embedding", x, c, sn, where=where)
                if dtype != torch.float32:
                    check_interleaved("interleaved_rotary_embedding_float32", x, c, sn, where=where)
                    check_interleaved("interleaved_rotary_embedding_float32_tables", x, c.float(), sn.float(),
                                      where=where)
            if dtype != torch.float32:  # ERNIE's float32 tables, values 16 bits cannot hold
                c, sn = rand(*bs, d, dtype=torch.float32), rand(*bs, d, dtype=torch.float32)
                check_interleaved("interleaved_rotary_embedding_float32_tables", x, c, sn,
                                  where=f"{dtype} d={d} x {lname}, float32 tables, random")
        for rot in {2, d // 4 * 2, d - 2} - {0, d}:
            c, sn = interleaved_tables(b, s, rot, dtype)
            for lname, x in layouts.items():
                if not lname.startswith("GPT-J"):
                    check_interleaved("partial_interleaved_rotary_embedding", x, c, sn, rot,
                                      where=f"{dtype} d={d} rotary_dim={rot} x {lname}")


def test_interleaved_rotary_special_values_and_one_kernel():
    x = special_rows()
    for dtype in DTYPES:
        cos, sin = interleaved_tables(2, 4, 16, dtype)
        check_interleaved("interleaved_rotary_embedding", x.to(dtype), cos, sin, where=f"{dtype} special values")
    q = rand(2, 64, 4 * 64, dtype=torch.bfloat16).view(2, 64, 4, 64).transpose(1, 2)
    cos, sin = interleaved_tables(2, 64, 64, torch.bfloat16)
    for name, args in (("interleaved_rotary_embedding", ()), ("interleaved_rotary_embedding_float32", ()),
                       ("partial_interleaved_rotary_embedding", (64,))):
        names = kernels_run(lambda: lib.op(name)(q, cos, sin, *args))
        assert runs_only(names, "interleaved_rotary_strided"), names  # one kernel: no copy of q first
    cos32, sin32 = cos.float(), sin.float()
    names = kernels_run(lambda: lib.op("interleaved_rotary_embedding_float32_tables")(q, cos32, sin32))
    assert runs_only(names, "interleaved_rotary_strided_float32_tables"), names
    for dtype in (torch.float16, torch.bfloat16):
        c, sn = interleaved_tables(2, 4, 16, torch.float32)
        check_interleaved("interleaved_rotary_embedding_float32_tables", x.to(dtype), c, sn,
                          where=f"{dtype} special values, float32 tables")
    empty = q[:, :, :0]
    assert lib.op("interleaved_rotary_embedding")(empty, cos[:, :, :0], sin[:, :, :0]).shape == empty.shape
    torch.cuda.synchronize()


# ---- DeepSeek-V3's rotation: pairs (2j, 2j + 1) into halves (j, D/2 + j), equal to the bit --------------


def check_deinterleaved(x, cos, sin, where):
    """DeepSeek-V3's op against the pattern of its tables' form (half the head wide: the even/odd slices;
    whole: the copy and rotate_half) run by eager PyTorch: the same bits, contiguous as eager's. GPT-OSS's
    chunked op, the same kernels reading x's halves, against its pattern (half-wide tables) or
    rotate_half's (whole ones: the same bits, contiguous where eager keeps x's layout)."""
    poison()
    got = lib.op("deinterleaved_rotary_embedding")(x, cos, sin)
    pattern = (deinterleaved_rotary.deinterleaved_rotary_embedding_sliced if cos.shape[-1] != x.shape[-1]
               else deinterleaved_rotary.deinterleaved_rotary_embedding_copied)
    if x.shape[-1] == 2:  # eager's cat of one-column halves keeps x's order of heads and positions
        same_bits(got, pattern(x, cos, sin), f"deinterleaved_rotary_embedding {where}")
    else:
        same_as_eager(got, pattern(x, cos, sin), f"deinterleaved_rotary_embedding {where}")
    poison()
    got = lib.op("chunked_rotary_embedding")(x, cos, sin)
    want = deinterleaved_rotary.chunked_rotary_embedding(x, cos, sin)
    if x.shape[-1] == 2 or cos.shape[-1] == x.shape[-1]:
        same_bits(got, want, f"chunked_rotary_embedding {where}")
    else:
        same_as_eager(got, want, f"chunked_rotary_embedding {where}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_deinterleaved_rotary_on_every_layout_and_head_size(dtype):
    torch.manual_seed(0)
    b, s, h = 3, 37, 5
    for d in HEAD_SIZES:
        cos, sin = rope_tables(b, s, d, dtype)  # cat(freqs, freqs): the old form's; its first half the new one's
        layouts = dict(gqa_layouts(b, s, h, d, dtype))
        # MLA's queries: the rotated part of each head, split off the projection's (b, s, h, nope + d) view
        layouts["MLA's q_rot, a split of wider projected heads"] = rand(b, s, h * (24 + d), dtype=dtype).view(
            b, s, h, 24 + d).transpose(1, 2)[..., 24:]
        for lname, x in layouts.items():
            tables = {"(b, 1, s, d / 2)": (cos[..., :d // 2], sin[..., :d // 2]),
                      "(1, 1, s, d / 2), contiguous": (cos[:1, ..., :d // 2].contiguous(), sin[:1, ..., :d // 2].contiguous()),
                      "(b, h, s, d / 2), random": (rand(b, h, s, d // 2, dtype=dtype), rand(b, h, s, d // 2, dtype=dtype)),
                      "(b, 1, s, d), the old form's": (cos, sin),
                      "(b, h, s, d), random halves": (rand(b, h, s, d, dtype=dtype), rand(b, h, s, d, dtype=dtype))}
            for tname, (c, sn) in tables.items():
                check_deinterleaved(x, c, sn, f"{dtype} d={d} x {lname}, cos {tname}")


def test_deinterleaved_rotary_special_values_and_one_kernel():
    x = special_rows()
    for dtype in DTYPES:
        cos, sin = rope_tables(2, 4, 16, dtype)
        check_deinterleaved(x.to(dtype), cos[..., :8], sin[..., :8], f"{dtype} special values")
        check_deinterleaved(x.to(dtype), cos, sin, f"{dtype} special values, whole tables")
    q = rand(2, 64, 4 * 96, dtype=torch.bfloat16).view(2, 64, 4, 96).transpose(1, 2)[..., 32:]
    cos, sin = rope_tables(2, 64, 64, torch.bfloat16)
    for c, sn in ((cos[..., :32], sin[..., :32]), (cos, sin)):
        names = kernels_run(lambda: lib.op("deinterleaved_rotary_embedding")(q, c, sn))
        assert runs_only(names, "deinterleaved_rotary_strided"), names  # one kernel: no copy of q first
        names = kernels_run(lambda: lib.op("chunked_rotary_embedding")(q, c, sn))
        assert runs_only(names, "chunked_rotary_strided"), names
    empty = q[:, :, :0]
    for name in ("deinterleaved_rotary_embedding", "chunked_rotary_embedding"):
        assert lib.op(name)(empty, cos[:, :, :0, :32], sin[:, :, :0, :32]).shape == empty.shape
    torch.cuda.synchronize()


def test_rotary_op_checks_a_new_half_after_a_good_call():
    """The checks are decided once per call signature, scalars included, so the remembered launch of one
    call is not reused for a call that differs only in ``half``."""
    x = rand(2, 4, 16, 64, dtype=torch.float32)
    cos, sin = rope_tables(1, 16, 64, torch.float32)
    want = rotary.rotary_embedding(x, cos, sin, 32)
    for _ in range(2):
        torch.testing.assert_close(lib.op("rotary_embedding")(x, cos, sin, 32), want, rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match="half = 16"):
        lib.op("rotary_embedding")(x, cos, sin, 16)
    torch.cuda.synchronize()


# ---- a head's RMSNorm and its rotation in one kernel (Qwen3's and Gemma 3's queries and keys) ---------

# op name: (pattern, x as the norm reads it: (B, H, S, D) for Gemma 3's form, else (B, S, H, D))
NORM_ROTARY = {
    "rms_norm_rotary_embedding": (norm_rotary.rms_norm_rotary_embedding, False),
    "gemma_rms_norm_rotary_embedding": (norm_rotary.gemma_rms_norm_rotary_embedding, True),
    "rms_norm_rotary_embedding_repeat_kv": (norm_rotary.rms_norm_rotary_embedding_repeat_kv, False),
    "gemma_rms_norm_rotary_embedding_repeat_kv": (norm_rotary.gemma_rms_norm_rotary_embedding_repeat_kv, True),
}


def norm_rotary_layouts(b, s, h, d, dtype, heads_first):
    """x as Qwen3 (b, s, h, d) or Gemma 3 ((b, h, s, d) views) hand it to the norm, and other layouts."""
    projected = rand(b, s, h * d, dtype=dtype, scale=3.0).view(b, s, h, d)
    fused = rand(b, s, 3 * h * d, dtype=dtype)[..., h * d:2 * h * d].view(b, s, h, d)  # k of a fused QKV
    misaligned = torch.cat([projected.new_zeros(1), rand(b * s * h * d, dtype=dtype)])[1:].view(b, s, h, d)
    layouts = {"projected": projected, "a slice of a fused QKV projection": fused,
               "one element past alignment": misaligned,
               "heads made contiguous first": rand(b, h, s, d, dtype=dtype).transpose(1, 2)}
    return {k: v.transpose(1, 2) for k, v in layouts.items()} if heads_first else layouts


def check_norm_rotary(name, args, dtype):
    """The op against eager's pattern in the dtype (each of its roundings; the norm's sum of squares in
    another order) and, in float32, a float64 run of the pattern."""
    pattern = NORM_ROTARY[name][0]
    poison()
    got = lib.op(name)(*args)
    want = pattern(*args)
    where = f"{name} {dtype} x {tuple(args[0].shape)} {tuple(args[0].stride())}"
    assert got.shape == want.shape and got.dtype == want.dtype, where
    assert laid_out_as(got, want), f"{where}: strides {got.stride()}, eager's {want.stride()}"
    rtol, atol = EAGER_TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{where} vs eager: {m}")
    if dtype == torch.float32:
        exact = pattern(*upcast(args, torch.float64))
        rel = float((got.double() - exact).norm() / exact.norm().clamp_min(1e-30))
        assert rel < 1e-5, f"{where}: rel. error vs float64 {rel:.2e}"


# HEAD_SIZES, and heads whose 16-byte packs are not a power of two a half (80, 96, 192: a row's last
# thread group part idle) and a scalar row of 100 a half (4 elements a thread, the last ones partly idle)
NORM_ROTARY_HEADS = (*HEAD_SIZES, 80, 96, 192, 200)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_norm_rotary_on_every_layout_head_size_and_table(dtype):
    torch.manual_seed(0)
    for (b, s, h), d in itertools.product(((3, 37, 5), (4, 1, 8)), NORM_ROTARY_HEADS):  # s = 1: decoding
        cos, sin = rope_tables(b, s, d, dtype)
        tables = {"(b, 1, s, d)": (cos, sin), "(1, 1, s, d)": (cos[:1], sin[:1]),
                  "(1, h, s, d)": (rand(1, h, s, d, dtype=dtype), rand(1, h, s, d, dtype=dtype)),
                  "(b, h, s, d)": (rand(b, h, s, d, dtype=dtype), rand(b, h, s, d, dtype=dtype)),
                  "expanded over the batch": (cos[:1].expand(b, 1, s, d), sin[:1].expand(b, 1, s, d))}
        weight = rand(d, dtype=dtype)
        for name, (_, heads_first) in NORM_ROTARY.items():
            sizes = (b, h, 2, s, d, 2 * h) if name.endswith("repeat_kv") else ()
            for x in norm_rotary_layouts(b, s, h, d, dtype, heads_first).values():
                for c, sn in tables.values():
                    check_norm_rotary(name, (x, weight, c, sn, 1e-6, d // 2, *sizes), dtype)


def test_norm_rotary_reads_x_in_place_and_checks_its_inputs():
    b, s, h, d = 2, 64, 4, 128
    x = rand(b, s, h * d, dtype=torch.bfloat16).view(b, s, h, d)
    w = rand(d, dtype=torch.bfloat16)
    cos, sin = rope_tables(b, s, d, torch.bfloat16)
    for name, (_, heads_first) in NORM_ROTARY.items():
        sizes = (b, h, 2, s, d, 2 * h) if name.endswith("repeat_kv") else ()
        xs = x.transpose(1, 2) if heads_first else x
        names = kernels_run(lambda: lib.op(name)(xs, w, cos, sin, 1e-6, d // 2, *sizes))
        kernel = "norm_rotary_packs_repeat" if name.endswith("repeat_kv") else "norm_rotary_packs"
        assert runs_only(names, kernel), names  # one kernel, no copy first
        past = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)  # one element past alignment
        names = kernels_run(lambda: lib.op(name)(past.transpose(1, 2) if heads_first else past, w, cos, sin, 1e-6,
                                                 d // 2, *sizes))
        assert runs_only(names, "norm_rotary_strided"), names
    op = lib.op("rms_norm_rotary_embedding")
    with pytest.raises(fxkern.KernelInputError, match="head_dim 512 is more than 256"):
        big = rand(1, 2, 2, 512, dtype=torch.bfloat16)
        c, sn = rope_tables(1, 2, 512, torch.bfloat16)
        op(big, rand(512, dtype=torch.bfloat16), c, sn, 1e-6, 256)
    with pytest.raises(fxkern.KernelInputError, match=r"weight .* must be x's dtype"):
        op(x, w.float(), cos, sin, 1e-6, d // 2)
    with pytest.raises(fxkern.KernelInputError, match=r"must be \(head_dim,\) = \(128,\)"):
        op(x, rand(64, dtype=torch.bfloat16), cos, sin, 1e-6, d // 2)
    with pytest.raises(fxkern.KernelInputError, match="half = 32 rotates a last axis of 64"):
        op(x, w, cos, sin, 1e-6, 32)
    assert op(x[:, :0], w, cos[:, :, :0], sin[:, :, :0], 1e-6, d // 2).shape == (b, h, 0, d)
    torch.cuda.synchronize()
