"""Registration: schema, fake shapes (dynamic too), the reference impl, re-registration, bad calls."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxkern
import seven_cases
from fxkern import (
    Elementwise, InputDecl, KernelInputError, KernelSpec, Numel, OutputDecl, RegistrationError, SameAs, ScalarInput,
    SpecError,
)

SCALE = seven_cases.SCALE
ROOT = Path(__file__).resolve().parents[1]


def scale_spec(**kw):
    base = dict(inputs=[InputDecl("x"), ScalarInput("alpha", float)], outputs=[OutputDecl("y", SameAs("x"))],
                extras=[Numel("x")], geometry=Elementwise())
    base.update(kw)
    return KernelSpec(SCALE, "scale_kernel", **base)


def test_returns_the_torch_op_with_derived_schema(op_name):
    op = fxkern.cuda_kernel_op(op_name, scale_spec(), reference=seven_cases.scale_ref)
    ns, name = op_name.split("::")
    assert op is getattr(getattr(torch.ops, ns), name)
    assert str(op.default._schema) == f"{op_name}(Tensor x, float alpha) -> Tensor"


def test_registering_the_same_spec_again_is_a_no_op(op_name):
    a = fxkern.cuda_kernel_op(op_name, scale_spec(), reference=seven_cases.scale_ref)
    b = fxkern.cuda_kernel_op(op_name, scale_spec(), reference=seven_cases.scale_ref)
    assert a is b


def test_registering_a_different_spec_under_the_name_is_an_error(op_name):
    fxkern.cuda_kernel_op(op_name, scale_spec())
    with pytest.raises(RegistrationError, match="already registered with a different spec"):
        fxkern.cuda_kernel_op(op_name, scale_spec(geometry=Elementwise(block=(128,))))


def test_a_reference_or_geometry_differing_only_in_a_constant_is_a_different_spec(op_name):
    """``x * 2`` and ``x * 3``, or a Custom geometry's block of 256 and of 128, differ only in their
    code's constants or closures: re-registering with either is refused, where the bytecode alone
    took them for the old op (found by a review, 2026-11-26). The same functions again are a no-op."""
    from fxkern import Custom
    from fxkern.symbolic import cdiv

    def geometry(block):
        return lambda inputs, outputs: ((cdiv(inputs[0].numel(), block),), (block,))

    def spec(block):
        return scale_spec(geometry=Custom(geometry(block)))

    fxkern.cuda_kernel_op(op_name, spec(256), reference=lambda x, alpha: x * 2)
    fxkern.cuda_kernel_op(op_name, spec(256), reference=lambda x, alpha: x * 2)  # the same: no error
    with pytest.raises(RegistrationError, match="different spec"):
        fxkern.cuda_kernel_op(op_name, spec(256), reference=lambda x, alpha: x * 3)
    with pytest.raises(RegistrationError, match="different spec"):
        fxkern.cuda_kernel_op(op_name, spec(128), reference=lambda x, alpha: x * 2)
    with pytest.raises(RegistrationError, match="different spec"):  # a name the code loads
        fxkern.cuda_kernel_op(op_name, spec(256), reference=lambda x, alpha: torch.sin(x) * 2)

    def filled(fill, fn=torch.mul):
        return lambda x, alpha: fn(torch.nan_to_num(x, nan=fill), 2)

    other = op_name + "_2"
    fxkern.cuda_kernel_op(other, spec(256), reference=filled(float("nan")))
    fxkern.cuda_kernel_op(other, spec(256), reference=filled(float("nan")))  # a fresh NaN is the same constant
    with pytest.raises(RegistrationError, match="different spec"):  # a builtin in the closure, by name
        fxkern.cuda_kernel_op(other, spec(256), reference=filled(float("nan"), torch.add))


_FOREIGN = []  # kept alive: a collected Library leaves a stale op that breaks later decompositions


def test_name_taken_by_a_non_fxkern_op():
    lib = torch.library.Library("fxkern_foreign", "FRAGMENT")
    lib.define("taken(Tensor x) -> Tensor")
    _FOREIGN.append(lib)
    with pytest.raises(RegistrationError, match="not an fxkern op"):
        fxkern.cuda_kernel_op("fxkern_foreign::taken", scale_spec())


@pytest.mark.parametrize("bad", ["noname", "a::b::c", "ns::1x", "aten::myop", ""])
def test_bad_op_names(bad):
    with pytest.raises(RegistrationError):
        fxkern.cuda_kernel_op(bad, scale_spec())


def test_reference_is_the_cpu_impl(op_name):
    op = fxkern.cuda_kernel_op(op_name, scale_spec(), reference=seven_cases.scale_ref)
    x = torch.randn(5, 7)
    torch.testing.assert_close(op(x, 2.5), x * 2.5)


@pytest.mark.parametrize("past_limits, reference, words", [
    ("fallback", seven_cases.scale_ref, "past_limits= must be 'raise', 'reference' or 'split'"),
    ("reference", None, "past_limits='reference' needs reference="),
])
def test_past_limits_is_checked_at_registration(op_name, past_limits, reference, words):
    with pytest.raises(SpecError, match=words):
        fxkern.cuda_kernel_op(op_name, scale_spec(), reference=reference, past_limits=past_limits)


def refuses_large(x, alpha):
    """An eager_fn standing in for a launch past the kernel's sizes (it raises before any launch)."""
    if x.numel() > 8:
        raise fxkern.SizeLimitError(f"x has {x.numel()} elements, past the kernel's 8")
    raise KernelInputError("a call the kernel refuses for another reason")


def test_calls_past_the_limits_run_the_reference_when_asked(op_name, caplog):
    """The CUDA impl's fallback, called here on CPU tensors: the reference's result, laid out as the
    fake impl says (the meta_fn keeps x's transposed layout), with one warning per op; other refusals
    still raise, and without past_limits the size error itself."""
    fxkern.cuda_kernel_op(op_name, scale_spec(), reference=lambda x, a: (x * a).contiguous(),
                          meta_fn=lambda x, a: torch.empty_like(x), eager_fn=refuses_large, past_limits="reference")
    cuda = fxkern.kernel_op(op_name).cuda_impl
    x = torch.randn(4, 6).t()
    with caplog.at_level("WARNING", logger="fxkern"):
        for _ in range(2):
            y = cuda(x, 2.0)
            torch.testing.assert_close(y, x * 2.0)
            assert y.stride() == x.stride()
    assert caplog.text.count("run the op's reference instead") == 1 and "past the kernel's 8" in caplog.text
    with pytest.raises(KernelInputError, match="another reason"):
        cuda(torch.randn(2), 2.0)
    fxkern.cuda_kernel_op(op_name + "_raises", scale_spec(), reference=seven_cases.scale_ref, eager_fn=refuses_large)
    with pytest.raises(fxkern.SizeLimitError, match="past the kernel's 8"):
        fxkern.kernel_op(op_name + "_raises").cuda_impl(x, 2.0)


def test_the_reference_runs_without_what_the_refused_call_made(op_name):
    """Run inside the ``except``, the reference kept the refused call's frames alive through the
    traceback, with the copies and outputs it had made: at 2^31 elements, gigabytes on top of the
    reference's own (found by a review)."""
    import gc
    import weakref

    made = []

    def eager(x, alpha):
        scratch = torch.empty(1000)  # an output or copy made before the size check
        made.append(weakref.ref(scratch))
        raise fxkern.SizeLimitError("past the kernel's sizes")

    def reference(x, alpha):
        gc.collect()
        assert made[0]() is None, "the refused call's tensors are still alive"
        return x * alpha

    fxkern.cuda_kernel_op(op_name, scale_spec(), reference=reference, eager_fn=eager, past_limits="reference")
    x = torch.randn(4)
    torch.testing.assert_close(fxkern.kernel_op(op_name).cuda_impl(x, 2.0), x * 2.0)


def test_reference_output_never_aliases_an_input(op_name):
    spec = KernelSpec(seven_cases.SIGMOID, "sigmoid_kernel", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[Numel("x")], geometry=Elementwise(), dtypes=(torch.float32,))
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda x: x)  # an identity reference
    x = torch.randn(4)
    y = op(x)
    assert y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(y, x)


def test_cpu_impl_lays_its_output_out_as_the_fake_impl_says(op_name):
    # a meta_fn that keeps x's layout (as eager's elementwise ops do): the CPU path returns that
    # layout whatever the reference returns, as the CUDA path must
    def meta(x, alpha):
        return torch.empty_like(x)

    op = fxkern.cuda_kernel_op(op_name, scale_spec(), meta_fn=meta,
                               reference=lambda x, a: (x * a).contiguous())
    x = torch.randn(4, 6).t()
    y = op(x, 2.0)
    assert y.stride() == x.stride() and not y.is_contiguous()
    torch.testing.assert_close(y, x * 2.0)
    assert op(x.contiguous(), 2.0).is_contiguous()


def test_the_cpu_path_checks_scalars_as_the_cuda_launch_does(op_name):
    """An int scalar past the kernel's 32-bit int went through on the CPU and failed only on a GPU
    (found by a usability test)."""
    src = SCALE.replace("float alpha", "int alpha")
    op = fxkern.cuda_kernel_op(op_name, KernelSpec(src, "scale_kernel", inputs=[InputDecl("x"), ScalarInput("alpha", int)],
                                                   outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")],
                                                   geometry=Elementwise()),
                               reference=lambda x, alpha: x * alpha)
    torch.testing.assert_close(op(torch.ones(3), 2), torch.full((3,), 2.0))
    with pytest.raises(KernelInputError, match=r"scalar 'alpha' = 1099511627776 does not fit the kernel's 32-bit int"):
        op(torch.ones(3), 2**40)


def test_reference_that_disagrees_with_the_declared_output_is_reported(op_name):
    op = fxkern.cuda_kernel_op(op_name, scale_spec(), reference=lambda x, a: (x * a).double())
    with pytest.raises(SpecError, match="reference output 0 is torch.float64"):
        op(torch.randn(3), 1.0)


def test_cpu_without_reference_says_what_to_do(op_name):
    op = fxkern.cuda_kernel_op(op_name, scale_spec())
    with pytest.raises(KernelInputError, match="has no CPU implementation.*reference="):
        op(torch.randn(3), 1.0)


def test_fake_impl_under_dynamic_export():
    ops = seven_cases.register_all()

    class M(torch.nn.Module):
        def forward(self, x):
            s, c = ops["sin_cos"](x)
            return ops["row_sum"](s + c), ops["repeat2"](x)

    batch = torch.export.Dim.DYNAMIC  # (named Dims hit a torch 2.11 bug in its own error formatting)
    ep = torch.export.export(M(), (torch.randn(8, 33),), dynamic_shapes=({0: batch},))
    outs = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    row_val, rep_val = outs[0].meta["val"], outs[1].meta["val"]
    assert isinstance(row_val.shape[0], torch.SymInt)
    assert str(rep_val.shape[0]) == f"2*{row_val.shape[0]}"
    x = torch.randn(19, 33)
    r, rep = ep.module()(x)
    torch.testing.assert_close(r, (torch.sin(x) + torch.cos(x)).sum(-1))
    torch.testing.assert_close(rep, torch.cat([x, x]))


def test_fake_impl_checks_dtype_and_shape():
    ops = seven_cases.register_all()
    with torch._subclasses.FakeTensorMode():
        with pytest.raises(KernelInputError, match="float64"):
            ops["sigmoid"](torch.empty(3, dtype=torch.float64))
        with pytest.raises(KernelInputError, match="shape"):
            ops["add"](torch.empty(3, 4), torch.empty(4, 3))
        out = ops["row_sum"](torch.empty(3, 4, dtype=torch.bfloat16))
        assert out.shape == (3,) and out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda o: o["sigmoid"](torch.randn(3, dtype=torch.float64)), "is torch.float64, but the kernel is built for torch.float32, torch.float16, torch.bfloat16"),
        (lambda o: o["add"](torch.randn(3), torch.randn(3, dtype=torch.float16)), "inputs without their own InputDecl.dtype must share one dtype"),
        (lambda o: o["scale"](torch.randn(3, dtype=torch.float16), 1.0), "convert the input, or add torch.float16 to KernelSpec.dtypes"),
        (lambda o: o["add"](torch.randn(3, 4), torch.randn(4, 3)), "an Elementwise kernel needs equal shapes"),
        (lambda o: o["add"](torch.randn(3, 4), torch.randn(4)), "declare InputDecl('b', broadcast=True)"),
        (lambda o: o["relu_2d"](torch.randn(7)), "the 'nd' launch, which tiles the output's last 2 axes, reads 2 axes"),
    ],
)
def test_bad_calls_are_clear_errors(call, words):
    ops = seven_cases.register_all()
    with pytest.raises(KernelInputError) as info:
        call(ops)
    assert words in str(info.value)


def test_broadcast_input_must_broadcast(op_name):
    src = 'extern "C" __global__ void bias_add(const float* x, const float* b, int n, int d, float* y) {}'
    spec = KernelSpec(src, "bias_add", inputs=[InputDecl("x"), InputDecl("b", broadcast=True)],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x"), fxkern.DimSize("x", -1)], geometry=Elementwise())
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda x, b: x + b)
    x, b = torch.randn(4, 6), torch.randn(6)
    torch.testing.assert_close(op(x, b), x + b)
    torch.testing.assert_close(op(x, b.view(1, 6)), x + b)
    with pytest.raises(KernelInputError, match="does not broadcast"):
        op(x, torch.randn(5))


def test_broadcast_input_is_checked_for_every_geometry(op_name):
    """A row kernel reading a (D,) weight: a (N, 1) weight would be indexed wrongly, so it is refused
    before launch (the fake impl refuses it too, so no rewrite or compile can produce that call)."""
    src = 'extern "C" __global__ void rows(const float* x, const float* w, int d, float* y) {}'
    spec = KernelSpec(src, "rows", inputs=[InputDecl("x"), InputDecl("w", broadcast=True)],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[fxkern.DimSize("x", -1)],
                      geometry=fxkern.Reduction(reduce_dims=(-1,)))
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda x, w: x * w)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert op(x, torch.empty(6)).shape == (4, 6)
        assert op(x, torch.empty(1, 6)).shape == (4, 6)
        with pytest.raises(KernelInputError, match="trailing axes"):
            op(x, torch.empty(4, 1))


@pytest.mark.gpu
def test_broadcast_input_checked_on_the_cuda_fast_path(op_name):
    src = 'extern "C" __global__ void bias_add(const float* x, const float* b, int n, int d, float* y) {}'
    spec = KernelSpec(src, "bias_add", inputs=[InputDecl("x"), InputDecl("b", broadcast=True)],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x"), fxkern.DimSize("x", -1)],
                      geometry=Elementwise())
    op = fxkern.cuda_kernel_op(op_name, spec)
    x = torch.randn(4, 6, device="cuda")
    for bad in (torch.randn(5, device="cuda"), torch.randn(4, 1, device="cuda")):
        with pytest.raises(KernelInputError, match="does not broadcast"):
            op(x, bad)


ROWS_SRC = 'extern "C" __global__ void rows(const float* x, const float* r, int d, float* y) {}'


def _rows_op(op_name, geometry, **kw):
    """A row kernel reading x and r alongside it (a residual), r declared without broadcast."""
    spec = KernelSpec(ROWS_SRC, "rows", inputs=[InputDecl("x"), InputDecl("r")], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[fxkern.DimSize("x", -1)], geometry=geometry)
    return fxkern.cuda_kernel_op(op_name, spec, reference=lambda x, r: x + r, **kw)


ROW_GEOMETRIES = [fxkern.Reduction(reduce_dims=(-1,)),
                  fxkern.Custom(lambda ins, outs: ((ins[0].numel((-1,)),), (128,)))]


@pytest.mark.parametrize("geometry", ROW_GEOMETRIES, ids=["Reduction", "Custom"])
def test_row_kernel_inputs_must_share_a_shape(op_name, geometry):
    """The kernel reads r row by row with x: an r of another shape would be read out of bounds, so the
    call is refused, on CPU, under fake tensors (export, compile) and on CUDA alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = _rows_op(op_name, geometry)
    x = torch.randn(4, 6)
    torch.testing.assert_close(op(x, x), x + x)
    for bad, advice in ((torch.randn(6), "broadcast=True"), (torch.randn(4, 5), "meta_fn"),
                        (torch.randn(1, 4, 6), "meta_fn")):
        with pytest.raises(KernelInputError, match=r"input 'r' has shape .* but 'x' has \(4, 6\).*" + advice):
            op(x, bad)
        with FakeTensorMode() as mode, pytest.raises(KernelInputError, match="needs its shape"):
            op(mode.from_tensor(x), mode.from_tensor(bad))
    with pytest.raises(KernelInputError) as info:
        op(x, torch.randn(4, 5))
    assert "broadcast=True" not in str(info.value)  # (4, 5) is no trailing part of (4, 6): no such advice


def test_a_per_row_operand_of_a_reduction_has_the_output_shape(op_name):
    """Labels of a cross-entropy, a per-row scale: one value per row, output 0's shape (refused for a
    while this session; found by a review)."""
    src = 'extern "C" __global__ void xent(const float* logits, const float* labels, int d, float* y) {}'
    spec = KernelSpec(src, "xent", inputs=[InputDecl("logits"), InputDecl("labels")],
                      outputs=[OutputDecl("y", fxkern.ReduceDims("logits", (-1,)))], extras=[fxkern.DimSize("logits", -1)],
                      geometry=fxkern.Reduction(reduce_dims=(-1,)))
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda logits, labels: logits.sum(-1) * labels)
    logits, labels = torch.randn(4, 10), torch.randn(4)
    torch.testing.assert_close(op(logits, labels), logits.sum(-1) * labels)
    with pytest.raises(KernelInputError, match=r"or output 0's \(4,\) \(one value per row\)"):
        op(logits, torch.randn(5))


def test_a_meta_fn_owns_the_shape_checks(op_name):
    """A kernel reading inputs of unrelated shapes gives a meta_fn; fxkern then checks no shapes itself."""
    op = _rows_op(op_name, ROW_GEOMETRIES[0], meta_fn=lambda x, r: x.new_empty(x.shape))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert op(torch.empty(4, 6), torch.empty(3)).shape == (4, 6)


@pytest.mark.parametrize("call, words", [
    (lambda o: o["row_sum"](torch.tensor(1.0)), "input 'x' has 0 axes (shape ()), but Reduction(reduce_dims=(-1,)) reads 1 axis"),
    (lambda o: o["relu_2d"](torch.tensor(1.0)), "the 'nd' launch, which tiles the output's last 2 axes, reads 2 axes"),
])
def test_too_few_axes_is_an_error_naming_the_input(call, words):
    """A 0-d tensor failed with an IndexError about "input 0"; now the input and what reads it are named."""
    with pytest.raises(KernelInputError) as info:
        call(seven_cases.register_all())
    assert words in str(info.value)


def test_too_few_axes_for_an_extra_or_custom_geometry(op_name):
    src = 'extern "C" __global__ void k(const float* x, const float* w, int d, float* y) {}'
    spec = KernelSpec(src, "k", inputs=[InputDecl("x"), InputDecl("w", broadcast=True)],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[fxkern.DimSize("w", -2)],
                      geometry=fxkern.Custom(lambda ins, outs: ((ins[0][-3],), (32,))))
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda x, w: x * w)
    with pytest.raises(KernelInputError, match=r"input 'x' has 2 axes .* the launch geometry reads 3 axes"):
        op(torch.randn(4, 6), torch.randn(2, 6))
    with pytest.raises(KernelInputError, match=r"input 'w' has 1 axis .* extra DimSize\('w', -2\) reads 2 axes"):
        op(torch.randn(3, 4, 6), torch.randn(6))
    assert op(torch.randn(3, 4, 6), torch.randn(1, 6)).shape == (3, 4, 6)


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", ROW_GEOMETRIES, ids=["Reduction", "Custom"])
def test_row_kernel_inputs_checked_on_the_cuda_fast_path(op_name, geometry):
    op = _rows_op(op_name, geometry)
    x = torch.randn(4, 6, device="cuda")
    op(x, x)  # a good signature first: the next calls differ from it
    for bad in (torch.randn(6, device="cuda"), torch.randn(4, 5, device="cuda"), torch.tensor(1.0, device="cuda")):
        with pytest.raises(KernelInputError, match="input 'r' has"):
            op(x, bad)
    with pytest.raises(KernelInputError, match="input 'x' has 0 axes"):
        op(torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda"))
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_elementwise_inputs_are_checked_against_output_0_on_the_cuda_fast_path(op_name):
    """Output 0 shaped like a broadcast input: the fast path compared the inputs with the first
    non-broadcast one and let through calls the CPU and fake paths refuse (found by a review)."""
    src = 'extern "C" __global__ void k(const float* a, const float* b, int n, float* y) {}'
    spec = KernelSpec(src, "k", inputs=[InputDecl("a"), InputDecl("b", broadcast=True)],
                      outputs=[OutputDecl("y", SameAs("b"))], extras=[Numel("b")], geometry=Elementwise())
    op = fxkern.cuda_kernel_op(op_name, spec, reference=lambda a, b: a + b)
    for device in ("cpu", "cuda"):
        with pytest.raises(KernelInputError, match="input 'a' has shape"):
            op(torch.randn(2, 3, 4, device=device), torch.randn(3, 4, device=device))
    torch.cuda.synchronize()


SIGMOID_FLAT = r"""
extern "C" __global__ void sig(const float* x, int n, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 1.0f / (1.0f + expf(-x[i]));
}
"""


@pytest.mark.gpu
def test_a_meta_fn_layout_gets_the_values_of_a_row_major_kernel(op_name, caplog):
    """``torch.empty_like(x)`` in a meta_fn keeps a permuted x's strides; the kernel writes row-major, so
    the result is copied into that layout (it came back permuted), with one warning saying so."""
    spec = KernelSpec(SIGMOID_FLAT, "sig", inputs=[InputDecl("x")], extras=[Numel("x")],
                      geometry=fxkern.Custom(lambda ins, outs: ((fxkern.cdiv(ins[0].numel(), 256),), (256,))))
    op = fxkern.cuda_kernel_op(op_name, spec, meta_fn=lambda x: torch.empty_like(x), schema="(Tensor x) -> Tensor")
    x = torch.randn(300, 200, device="cuda").t()
    with caplog.at_level("WARNING", logger="fxkern"):
        for _ in range(3):  # the first call decides, the repeats take the remembered launch
            y = op(x)
            assert y.stride() == torch.empty_like(x).stride() == (1, 200)
            torch.testing.assert_close(y, torch.sigmoid(x))
    assert sum("copies its result into that layout" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(op(x.contiguous()), torch.sigmoid(x))  # contiguous: no copy, same values


@pytest.mark.parametrize("name", ["sigmoid", "add", "scale", "row_sum", "sin_cos", "relu_2d"])
def test_opcheck(name):
    ops = seven_cases.register_all()
    case = seven_cases.BY_NAME[name]
    args = case.make_inputs(case.shape, torch.float32, "cpu")
    torch.library.opcheck(ops[name], args)


def _ptx_of(src, name):
    return fxkern.compiler.compile_source(src, [name]).ptx


def test_ptx_op_infers_schema_from_meta_fn(op_name):
    ptx = _ptx_of(SCALE, "scale_kernel")

    def meta(x: torch.Tensor, alpha: float) -> torch.Tensor:
        return torch.empty_like(x)

    op = fxkern.ptx_op(op_name, ptx, "scale_kernel", meta_fn=meta, reference=seven_cases.scale_ref)
    assert str(op.default._schema) == f"{op_name}(Tensor x, float alpha) -> Tensor"
    x = torch.randn(6)
    torch.testing.assert_close(op(x, 3.0), 3 * x)
    assert fxkern.kernel_op(op_name).ptx == ptx


def test_ptx_op_without_the_entry_names_what_is_there(op_name):
    with pytest.raises(SpecError, match=r"no \.entry 'other'.*scale_kernel"):
        fxkern.ptx_op(op_name, _ptx_of(SCALE, "scale_kernel"), "other", meta_fn=lambda x: x)


def test_ptx_op_rejects_non_ptx(op_name):
    with pytest.raises(SpecError, match="must be PTX text"):
        fxkern.ptx_op(op_name, b"\x7fELF...", "k", meta_fn=lambda x: x)


def test_registration_does_no_gpu_work():
    # In a fresh process: registering every example initialises no CUDA context.
    code = (
        "import sys, torch; sys.path.insert(0, 'examples'); import seven_cases; "
        "seven_cases.register_all(); print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_signatures_stay_bounded_when_shapes_never_repeat():
    # A sequence growing a token a call brings a new signature every call: the memo starts over at
    # MAX_SIGNATURES instead of holding every one, and keeps answering for the newest.
    from fxkern.ops import MAX_SIGNATURES, Signatures

    seen = Signatures()
    for n in range(MAX_SIGNATURES + 5):
        assert seen.remember((n,), n) == n
        assert seen[(n,)] == n and len(seen) <= MAX_SIGNATURES
    assert len(seen) == 5


def test_the_eager_path_compiles_an_arch_override_for_its_own_gpu(op_name, monkeypatch):
    """A spec for sm_90a (wgmma, setmaxnreg) compiles for sm_90a at registration, and for its first
    launch on an sm_90 GPU too: the launcher compiled for sm_90 from the device's capability, where
    NVRTC refuses wgmma (found by a review, 2026-11-26). No GPU needed: the capability is the device's
    answer, and the launcher's image is compiled without launching."""
    src = r'''extern "C" __global__ void k90a(const float* x, int n, float* y) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
      int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = x[i]; }'''
    spec = KernelSpec(src, "k90a", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[Numel("x")], geometry=Elementwise(), arch_override="sm_90a")
    fxkern.cuda_kernel_op(op_name, spec)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    image = fxkern.kernel_op(op_name).cuda_impl.functions._image_for(0)
    assert image[:4] == b"\x7fELF"  # a CUBIN, for sm_90a


MASKED_SRC = r'''extern "C" __global__ void masked(const bool* m, const float* x, int n, float* y) {
  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = m[i] ? x[i] : 0.f; }'''


def masked_spec(**kw):
    return KernelSpec(MASKED_SRC, "masked", inputs=[InputDecl("m", dtype=torch.bool), InputDecl("x", dtype=torch.float32)],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")], geometry=Elementwise(), **kw)


def test_an_output_of_pinned_inputs_has_the_dtype_of_the_input_it_is_shaped_like(op_name):
    """With every input's dtype pinned there is no call dtype: SameAs("x") gives x's dtype in the fake
    impl (what export sees), the CPU path and the CUDA path alike (the fake impl took input 0's, bool,
    and the CPU path raised; found by a review, 2026-11-26)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = fxkern.cuda_kernel_op(op_name, masked_spec(), reference=lambda m, x: torch.where(m, x, 0.0))
    assert fxkern.kernel_op(op_name).plan.output_dtype_from == (1,)
    with FakeTensorMode():
        assert op(torch.empty(3, dtype=torch.bool), torch.empty(3)).dtype == torch.float32
    assert torch.equal(op(torch.tensor([True, False]), torch.tensor([1.0, 2.0])), torch.tensor([1.0, 0.0]))


def test_dtypes_with_every_input_pinned_are_refused_at_registration(op_name):
    """No call could pick one of the instantiations (the first launch failed with KeyError: None)."""
    with pytest.raises(SpecError, match="every tensor input pins its dtype"):
        fxkern.cuda_kernel_op(op_name, masked_spec(dtypes=(torch.float32,)))


@pytest.mark.parametrize("schema, says", [
    ("(Tensor x) -> Tensor", "has 1 arguments, the spec 2 inputs"),
    ("(Tensor x, int alpha) -> Tensor", "argument 'alpha' is int, but the spec's input 'alpha' at that place is a float"),
    ("(Tensor x, float alpha) -> (Tensor, Tensor)", "returns 2 tensors, the spec declares 1 outputs"),
])
def test_a_schema_unlike_the_spec_is_refused_at_registration(op_name, schema, says):
    """A schema= must be the spec's inputs in order and return its outputs: one without `alpha` passed
    registration and export, then failed at launch with an IndexError (found by a review, 2026-11-26)."""
    with pytest.raises(SpecError, match=says.replace("(", r"\(").replace(")", r"\)")):
        fxkern.cuda_kernel_op(op_name, scale_spec(), schema=schema)
    assert fxkern.cuda_kernel_op(op_name, scale_spec(), schema="(Tensor x, float alpha) -> Tensor") is not None


def test_a_grid_of_no_blocks_for_a_nonempty_output_is_refused():
    """A grid that rounds down launches nothing: the output would be returned unwritten."""
    from fxkern import validate

    with pytest.raises(KernelInputError, match=r"grid \(0, 1, 1\).*output 'y' \(100,\) would be left unwritten.*cdiv"):
        validate.check_no_blocks("ns::op", (0, 1, 1), ["y"], [torch.empty(100)])
    validate.check_no_blocks("ns::op", (0, 1, 1), ["y"], [torch.empty(0, 4)])  # empty: nothing to write
    with pytest.raises(KernelInputError, match=r"grid \(-1, 1, 1\)"):
        validate.check_no_blocks("ns::op", (-1, 1, 1), ["y"], [torch.empty(0)])


def test_a_call_that_would_lose_gradients_warns_once(monkeypatch):
    """fxkern ops have no backward: training a rewritten program compiled by plain torch.compile left
    every grad None, with torch's warning only at backward (found by a probe). The call says so
    first; under no_grad and while torch.export traces it, there is nothing to lose."""
    from fxkern import validate
    from helpers import Fn

    op = fxkern.cuda_kernel_op("fxkern_test::scale_for_grads", scale_spec(), reference=lambda x, alpha: x * alpha)
    x = torch.randn(8, requires_grad=True)
    monkeypatch.setattr(validate, "_WARNED_NO_BACKWARD", [])
    with torch.no_grad():
        op(x, 2.0)
    torch.export.export(Fn(lambda t: op(t, 2.0)), (x,))
    assert validate._WARNED_NO_BACKWARD == []
    with pytest.warns(UserWarning, match="fxkern_test::scale_for_grads: called with inputs that require grad.*backend="):
        op(x, 2.0)
    monkeypatch.setattr(validate, "_WARNED_NO_BACKWARD", [])
    with pytest.warns(UserWarning, match="fxkern ops have no backward"):
        torch.compile(lambda t: op(t, 2.0).sum(), backend="aot_eager")(x)
    torch._dynamo.reset()
