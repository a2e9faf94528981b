"""The TensorRT path up to TensorRT's own calls, on the CPU.

TensorRT cannot be installed here. Plugin code is run against
``trt_standin`` — a stand-in that enforces the documented restrictions of
``tensorrt.plugin`` and evaluates expressions concretely — which shows the
derivation is right and respects the API's rules; it is no evidence that
TensorRT accepts the plugin. Tests that need real TensorRT are at the end
and skip with the reason when it cannot be imported.
"""


import importlib
import sys
import textwrap

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fxkern
import seven_cases
import trt_standin as standin
from helpers import Fn, example_cases, library_inputs, library_ops
from fxkern import InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput, symbolic as sym
from fxkern.library.rmsnorm import llama_rmsnorm
from fxkern.tensorrt import converter, plugin
from fxkern.tensorrt.decompositions import reproduced_table

API = plugin.Api(plugin=standin.plugin, DataType=standin.DataType)
ARCH = "sm_90"


@pytest.fixture(scope="module")
def example_ops():
    return seven_cases.register_all()


def _fake_outputs(op, args):
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = op(*[torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args])
    return out if isinstance(out, tuple) else (out,)


def _python_launch(pp, tensors, scalars):
    """What the eager launch computes for these sizes: the same expressions under Python ints."""
    plan = pp.entry.plan
    shapes = [list(t.shape) for t in tensors]
    outs = [list(o.shape) for o in _fake_outputs(pp.entry.op, _call_args(pp, tensors, scalars))]
    env = (shapes, outs)
    grid = tuple(sym.compile_expr(g)(env) for g in plan.grid)
    extras = [plugin.scalar_bits(v, t, n) for v, t, n in zip(scalars, pp.attr_types, pp.attr_names)]
    extras += [sym.compile_expr(e)(env) for e in plan.extras]
    return grid, plan.block, sym.compile_expr(plan.shared_mem)(env), extras


def _call_args(pp, tensors, scalars):
    args = [None] * len(pp.arg_names)
    for i, t in zip(pp.tensor_args, tensors):
        args[i] = t
    for i, v in zip(pp.scalar_args, scalars):
        args[i] = v
    return args


@pytest.mark.parametrize("case,dtype", example_cases())
def test_plugin_of_every_example_against_the_standin(example_ops, case, dtype):
    """Descriptor and AOT implementation: signatures by the fact sheet's rules, shapes, dtypes,
    launch and extras equal to what the eager launch computes from the same expressions."""
    op = example_ops[case.name]
    entry = fxkern.kernel_op(op._qualified_op_name if hasattr(op, "_qualified_op_name") else f"{seven_cases.NS}::{case.name}")
    pp = plugin.plan_plugin(entry)
    assert pp.why_not == ""
    args = case.make_inputs(case.shape, dtype, "cpu")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    attrs = dict(zip(pp.attr_names, scalars))

    describe = plugin.descriptor(pp, API)
    names, attr_types, n_out = standin.check_register(describe)
    assert names == list(pp.tensor_names) and list(attr_types) == list(pp.attr_names) and n_out == pp.n_outputs

    want = _fake_outputs(op, args)
    fake_pass = standin.run_descriptor(describe, [standin.desc(t, fake=True) for t in tensors], attrs, fake=True)
    assert [o.dtype for o in fake_pass] == [standin.TORCH_TO_TRT[w.dtype] for w in want]
    descs = [standin.desc(t) for t in tensors]
    outs = standin.run_descriptor(describe, descs, attrs, fake=False)
    assert [[d.value for d in o.shape_expr] for o in outs] == [list(w.shape) for w in want]

    if not pp.aot:
        assert case.name == "repeat2" or pp.why_jit
        return
    aot = plugin.aot_impl(pp, API, arch=ARCH)
    standin.check_aot_impl(aot, pp.tensor_names, dict(zip(pp.attr_names, pp.attr_types)))
    got = standin.run_aot_impl(aot, descs, scalars, outs)
    grid, block, smem, extras = _python_launch(pp, tensors, scalars)
    assert got["grid"] == grid and got["block"] == block and got["shared_mem"] == smem
    assert got["extras"] == extras
    plan = entry.plan
    compiled = plugin._compiled(entry.qualname, ARCH)
    assert got["name"] == compiled.entry(plan.name_expression(dtype if plan.dtypes else None))
    assert f".entry {got['name']}(" in got["ptx"] and ".target sm_90" in got["ptx"]


LIBRARY = library_ops()


@pytest.mark.parametrize("name", sorted(LIBRARY))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols", [1000, 4099])
def test_plugin_of_every_library_kernel_against_the_standin(name, dtype, cols):
    op = LIBRARY[name]
    entry = fxkern.kernel_op(name)
    pp = plugin.plan_plugin(entry)
    assert pp.aot, pp.why_jit
    args = library_inputs(op, dtype, "cpu", rows=37, cols=cols)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    scalars = [a for a in args if not isinstance(a, torch.Tensor)]
    describe = plugin.descriptor(pp, API)
    standin.check_register(describe)
    descs = [standin.desc(t) for t in tensors]
    outs = standin.run_descriptor(describe, descs, dict(zip(pp.attr_names, scalars)), fake=False)
    want = _fake_outputs(op, args)
    assert [[d.value for d in o.shape_expr] for o in outs] == [list(w.shape) for w in want]
    assert [o.dtype for o in outs] == [standin.TORCH_TO_TRT[w.dtype] for w in want]
    aot = plugin.aot_impl(pp, API, arch=ARCH)
    standin.check_aot_impl(aot, pp.tensor_names, dict(zip(pp.attr_names, pp.attr_types)))
    got = standin.run_aot_impl(aot, descs, scalars, outs)
    grid, block, smem, extras = _python_launch(pp, tensors, scalars)
    assert (got["grid"], got["block"], got["shared_mem"], got["extras"]) == (grid, block, smem, extras)


def test_expected_launch_values_spelled_out(example_ops):
    """Independent of the interpreters: sigmoid on 37x1000 launches cdiv(37000, 256) blocks of 256 with n."""
    pp = plugin.plan_plugin(fxkern.kernel_op(f"{seven_cases.NS}::sigmoid"))
    x = torch.empty(37, 1000, dtype=torch.float16)
    outs = standin.run_descriptor(plugin.descriptor(pp, API), [standin.desc(x)], {}, fake=False)
    got = standin.run_aot_impl(plugin.aot_impl(pp, API, arch=ARCH), [standin.desc(x)], [], outs)
    assert got["grid"] == (145, 1, 1) and got["block"] == (256, 1, 1) and got["extras"] == [37000]
    assert "sigmoid_kernel" in got["name"] and got["name"].startswith("_Z")  # the half instantiation, mangled


def test_scalar_input_becomes_float_bits_extra(example_ops):
    pp = plugin.plan_plugin(fxkern.kernel_op(f"{seven_cases.NS}::scale"))
    assert pp.aot and pp.attr_names == ("alpha",) and pp.attr_types == (float,)
    x = torch.empty(10, 3)
    outs = standin.run_descriptor(plugin.descriptor(pp, API), [standin.desc(x)], {"alpha": 0.37}, fake=False)
    got = standin.run_aot_impl(plugin.aot_impl(pp, API, arch=ARCH), [standin.desc(x)], [0.37], outs)
    bits = torch.tensor([0.37], dtype=torch.float32).view(torch.int32).item()
    assert got["extras"] == [bits, 30]


def test_meta_fn_output_shapes_become_expressions(example_ops):
    """repeat2 has a meta_fn (2 * x.shape[0], ...): its sizes are read off a symbolic run."""
    pp = plugin.plan_plugin(fxkern.kernel_op(f"{seven_cases.NS}::repeat2"))
    assert pp.output_shapes is None and pp.aot
    x = torch.empty(5, 3, 4)
    outs = standin.run_descriptor(plugin.descriptor(pp, API), [standin.desc(x)], {}, fake=False)
    assert [d.value for d in outs[0].shape_expr] == [10, 3, 4]
    got = standin.run_aot_impl(plugin.aot_impl(pp, API, arch=ARCH), [standin.desc(x)], [], outs)
    assert got["grid"] == (1, 1, 1) and got["extras"] == [60]


def test_sizes_past_int32_raise_in_the_standin_and_are_declined(example_ops):
    entry = fxkern.kernel_op(f"{seven_cases.NS}::sigmoid")
    pp = plugin.plan_plugin(entry)
    big = torch.empty(2**16, 2**16, device="meta")
    outs = standin.run_descriptor(plugin.descriptor(pp, API), [standin.desc(big)], {}, fake=False)
    with pytest.raises(OverflowError):
        standin.run_aot_impl(plugin.aot_impl(pp, API, arch=ARCH), [standin.desc(big)], [], outs)
    node = _node(entry.op.default, [big])
    assert "32-bit" in converter.refusal(pp, node)
    assert converter.refusal(pp, _node(entry.op.default, [torch.empty(8, 8, device="meta")])) == ""


def test_outputs_past_int32_are_declined_though_the_inputs_fit():
    """repeat_kv's eager_fn refuses an output of more than 2**31 - 1 elements (its op then runs the
    reference); TensorRT never runs the eager_fn, so the validator checks the outputs itself."""
    import fxkern.library as lib

    lib.rules()
    entry = fxkern.kernel_op("fxkern_lib::repeat_kv")
    pp = plugin.plan_plugin(entry)
    x, sizes = torch.empty(4, 1024, 2048, 128, device="meta"), (4, 1024, 2, 2048, 128, 2048)  # x: 2**30 elements
    node = _node(entry.op.default, [x], sizes, out=torch.empty(4, 2048, 2048, 128, device="meta"))
    assert "output 0 (4, 2048, 2048, 128) has more than 2**31 - 1 elements" in converter.refusal(pp, node)
    small = _node(entry.op.default, [x[:1, :8]], (1, 8, 2, 2048, 128, 16),
                  out=torch.empty(1, 16, 2048, 128, device="meta"))
    assert converter.refusal(pp, small) == ""


def _node(target, vals, extra_args=(), out=None):
    """A graph node calling ``target`` on placeholders of ``vals``; ``out``: its own val (what the op's
    fake impl gives, as torch.export records it)."""
    g = fx.Graph()
    phs = []
    for i, v in enumerate(vals):
        p = g.placeholder(f"x{i}")
        p.meta["val"] = v
        phs.append(p)
    n = g.call_function(target, tuple(phs) + tuple(extra_args))
    if out is not None:
        n.meta["val"] = out
    g.output(n)
    return n


def test_a_grid_past_cudas_65535_on_y_or_z_is_declined(example_ops):
    """The eager path refuses it; the validator let TensorRT launch it (found by a review)."""
    entry = fxkern.kernel_op(f"{seven_cases.NS}::relu_2d")
    pp = plugin.plan_plugin(entry)
    assert "grid z reaches 70000" in converter.refusal(pp, _node(entry.op.default, [torch.empty(70000, 8, 32, device="meta")]))
    assert converter.refusal(pp, _node(entry.op.default, [torch.empty(60000, 8, 32, device="meta")])) == ""


def test_meta_fn_outputs_are_checked_too():
    """An op whose output shapes come from meta_fn: its extras are checked against int32 at the node's
    output sizes (they went unchecked), a meta_fn disagreeing with the OutputDecls is declined (the plugin
    said half where the graph said float32), and so is one that branches on sizes (found by a review)."""
    import fxkern.library as lib

    lib.rules()
    entry = fxkern.kernel_op("fxkern_lib::swiglu_chunked")
    pp = plugin.plan_plugin(entry)
    for rows, ok in ((65536, False), (64, True)):
        x = torch.empty(rows, 65538, dtype=torch.float16, device="meta")
        why = converter.refusal(pp, _node(entry.op.default, [x], out=entry.fake_impl(x)))
        assert (why == "") == ok and (ok or "32-bit" in why), why

    src = """template <typename T> __global__ void up(const T* x, int n, float* y) {}"""
    spec = fxkern.KernelSpec(src, "up", inputs=[fxkern.InputDecl("x")], outputs=[fxkern.OutputDecl("y", fxkern.SameAs("x"))],
                             extras=[fxkern.Numel("x")], geometry=fxkern.Elementwise(), dtypes=[torch.float16, torch.float32])
    fxkern.cuda_kernel_op("fxkern_test_trt::upcast", spec, meta_fn=lambda x: x.new_empty(x.shape, dtype=torch.float32))
    entry = fxkern.kernel_op("fxkern_test_trt::upcast")
    x = torch.empty(4, 8, dtype=torch.float16, device="meta")
    why = converter.refusal(plugin.plan_plugin(entry), _node(entry.op.default, [x], out=entry.fake_impl(x)))
    assert "meta_fn disagrees with its OutputDecls" in why

    ptx = fxkern.compiler.compile_source('extern "C" __global__ void halve(const float* x, float* y) {}', ["halve"]).ptx
    fxkern.ptx_op("fxkern_test_trt::halve", ptx, "halve", schema="(Tensor x) -> Tensor",
                  meta_fn=lambda x: x.new_empty((x.shape[0] // 2 if x.shape[0] % 2 == 0 else x.shape[0], 3)),
                  aot_fn=lambda *a: None)
    entry = fxkern.kernel_op("fxkern_test_trt::halve")
    x = torch.empty(8, 3, device="meta")
    why = converter.refusal(plugin.plan_plugin(entry), _node(entry.op.default, [x], out=entry.fake_impl(x)))
    assert "branches on input sizes" in why


def test_a_kernel_writing_a_strided_layout_gets_no_plugin():
    """strided_outputs=True kernels write meta_fn's layout; TensorRT's buffers are linear."""
    import fxkern.library as lib

    lib.rules()
    pp = plugin.plan_plugin(fxkern.kernel_op("fxkern_lib::_rotary_strided"))
    assert "linear" in pp.why_not


def test_validator_declines_what_the_plugin_cannot_take(example_ops):
    entry = fxkern.kernel_op(f"{seven_cases.NS}::scale")
    pp = plugin.plan_plugin(entry)
    x = torch.empty(4, 4, device="meta")
    assert converter.refusal(pp, _node(entry.op.default, [x], (0.5,))) == ""
    assert "float64" in converter.refusal(pp, _node(entry.op.default, [x.double()], (0.5,)))
    g_node = _node(entry.op.default, [x, torch.empty((), device="meta")])
    assert "constant" in converter.refusal(pp, g_node)
    deep = torch.empty([1] * 9, device="meta")
    assert "rank 9" in converter.refusal(pp, _node(entry.op.default, [deep], (0.5,)))


def test_attributes_in_register_order_with_exact_types(op_name):
    """The fact sheet's ordering trap: attributes keyed in register order, an int passed for a float coerced."""
    src = 'extern "C" __global__ void k(const float* x, int n, float a, bool b, int m, float* y) {}'
    spec = KernelSpec(src, "k", inputs=[InputDecl("x"), ScalarInput("n", int), ScalarInput("a", float),
                                        ScalarInput("b", bool)], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[Numel("x")], geometry=fxkern.Elementwise())
    op = fxkern.cuda_kernel_op(op_name, spec)
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    t = object()
    tensors, attrs = plugin.plugin_arguments(pp, (t,), {"b": 1, "a": 2, "n": 3})
    assert tensors == [t] and list(attrs) == ["n", "a", "b"]
    assert attrs == {"n": 3, "a": 2.0, "b": True} and type(attrs["a"]) is float and type(attrs["b"]) is bool
    assert op is not None


def test_scalar_before_tensor_falls_back_to_jit_with_the_reason(op_name):
    src = 'extern "C" __global__ void k(float a, const float* x, int n, float* y) {}'
    spec = KernelSpec(src, "k", inputs=[ScalarInput("a", float), InputDecl("x")],
                      outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")], geometry=fxkern.Elementwise())
    fxkern.cuda_kernel_op(op_name, spec)
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    assert not pp.aot and "before a tensor input" in pp.why_jit
    with pytest.raises(fxkern.FxkernError, match="no AOT implementation"):
        plugin.aot_impl(pp, API)
    sig = plugin.jit_impl(pp, API).__signature__
    assert list(sig.parameters) == ["x", "a", "outputs", "stream"]
    node = _node(fxkern.kernel_op(op_name).op.default, [], ())
    with pytest.raises(fxkern.FxkernError, match="strict AOT"):
        converter.refusal(pp, node, strict_aot=True)


PTX_64 = textwrap.dedent("""
    .version 8.0
    .target sm_90
    .address_size 64
    .visible .entry k64(
        .param .u64 k64_param_0,
        .param .f64 k64_param_1,
        .param .u64 k64_param_2
    )
    {
        ret;
    }
""")


def test_ptx_op_with_a_64_bit_scalar_is_jit(op_name):
    fxkern.ptx_op(op_name, PTX_64, "k64", meta_fn=lambda x, a: torch.empty_like(x),
                  schema="(Tensor x, float a) -> Tensor", aot_fn=lambda ins, outs, tactic: None)
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    assert not pp.aot and "64-bit" in pp.why_jit


def test_ptx_op_without_aot_fn_is_jit(op_name):
    ptx = PTX_64.replace(".param .f64 k64_param_1,\n", "").replace("k64_param_2", "k64_param_1")
    fxkern.ptx_op(op_name, ptx, "k64", meta_fn=lambda x: torch.empty_like(x),
                  schema="(Tensor x) -> Tensor", eager_fn=lambda x: x.clone())
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    assert not pp.aot and "aot_fn" in pp.why_jit and not pp.why_not
    x = torch.empty(4, 4, device="meta")
    node = _node(fxkern.kernel_op(op_name).op.default, [x])
    assert converter.refusal(pp, node) == ""
    assert "bfloat16" in converter.refusal(pp, _node(fxkern.kernel_op(op_name).op.default,
                                                     [x.to(torch.bfloat16)]))  # JIT buffers cannot be bf16


def test_ptx_op_with_no_launch_at_all_gets_no_plugin(op_name):
    ptx = PTX_64.replace(".param .f64 k64_param_1,\n", "").replace("k64_param_2", "k64_param_1")
    fxkern.ptx_op(op_name, ptx, "k64", meta_fn=lambda x: torch.empty_like(x), schema="(Tensor x) -> Tensor")
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    assert "neither aot_fn" in pp.why_not
    assert converter.refusal(pp, _node(fxkern.kernel_op(op_name).op.default, [torch.empty(2, device="meta")]))


def test_defaulted_scalars_left_out_by_export_are_filled_from_the_schema(op_name):
    """torch.export drops trailing arguments at their default; the plugin still needs every attribute."""
    fxkern.ptx_op(op_name, PTX_64, "k64", meta_fn=lambda x, a=1.5: torch.empty_like(x),
                  schema="(Tensor x, float a=1.5) -> Tensor", aot_fn=lambda ins, outs, tactic: None)
    entry = fxkern.kernel_op(op_name)
    ep = torch.export.export(Fn(lambda x: entry.op(x)), (torch.randn(3),))
    node = next(n for n in ep.graph.nodes if n.target == entry.op.default)
    pp = plugin.plan_plugin(entry)
    tensors, attrs = plugin.plugin_arguments(pp, node.args, dict(node.kwargs))
    assert attrs == {"a": 1.5} and len(tensors) == 1


def test_scalars_that_cannot_be_32_bit_are_declined(example_ops):
    entry = fxkern.kernel_op(f"{seven_cases.NS}::scale")
    pp = plugin.plan_plugin(entry)
    x = torch.empty(4, 4, device="meta")
    assert "32-bit" in converter.refusal(pp, _node(entry.op.default, [x], (1e39,)))


def test_ptx_op_aot_fn_gives_the_launch(op_name):
    ptx = PTX_64.replace(".param .f64 k64_param_1,\n", "").replace("k64_param_2", "k64_param_1")

    def aot_fn(inputs, outputs, tactic):
        n = inputs[0].shape_expr.numel()
        return standin.KernelLaunchParams(grid_x=standin.cdiv(n, 128), block_x=128), None

    fxkern.ptx_op(op_name, ptx, "k64", meta_fn=lambda x: torch.empty_like(x), schema="(Tensor x) -> Tensor",
                  aot_fn=aot_fn)
    pp = plugin.plan_plugin(fxkern.kernel_op(op_name))
    assert pp.aot
    x = torch.empty(3, 100)
    outs = standin.run_descriptor(plugin.descriptor(pp, API), [standin.desc(x)], {}, fake=False)
    got = standin.run_aot_impl(plugin.aot_impl(pp, API), [standin.desc(x)], [], outs)
    assert got["name"] == "k64" and got["grid"] == (3, 1, 1) and got["block"] == (128, 1, 1)
    assert got["extras"] == []


def test_the_standin_is_not_vacuous():
    """It rejects what the fact sheet says TensorRT rejects, so passing it means something."""
    with standin.building():
        n = standin.ShapeExpr(10)
        with pytest.raises(TypeError):
            2 * n  # no reflected operators
        with pytest.raises(standin.StandInError):
            bool(n == 10)
        with pytest.raises(standin.StandInError):
            standin.cdiv(3, 4)
        with pytest.raises(OverflowError):
            n * 2**30
        with pytest.raises(standin.StandInError):
            standin.SymInt32(0.5)
        trap = standin.SymIntExprs(1)
        trap[0] = 5
        assert not isinstance(trap[0], standin.SymInt32)
    assert standin.ShapeExpr(3).is_fake  # a constant made outside a build is fake

    def bad_register(x: standin.TensorDesc, eps: float = 1e-6) -> standin.TensorDesc:
        return x

    with pytest.raises(standin.StandInError, match="default"):
        standin.check_register(bad_register)


# ---- the lowering pass, on graphs decomposed as Torch-TensorRT decomposes them -----------------


def swiglu(a, b):
    return torch.nn.functional.silu(a) * b


class Block(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.gate = torch.nn.Linear(d, 2 * d)
        self.up = torch.nn.Linear(d, 2 * d)

    def forward(self, x):
        h = llama_rmsnorm(x, self.weight, 1e-6)
        return swiglu(self.gate(h), self.up(h)).view(-1)


@pytest.fixture(scope="module")
def trt_rules():
    from helpers import spec_like

    rules = fxkern.RuleSet("trt-test")
    fxkern.replace(llama_rmsnorm, spec_like(llama_rmsnorm), name="fxkern_trt_test::rmsnorm", rules=rules)
    fxkern.replace(swiglu, spec_like(swiglu), name="fxkern_trt_test::swiglu", rules=rules)
    return rules


def _lowered(model, x):
    """The graph Torch-TensorRT's lowering passes see: export, then its decomposition table."""
    ep = torch.export.export(model, (x,)).run_decompositions(reproduced_table())
    return ep.module()


def test_reproduced_table_decomposes_like_torch_tensorrt():
    gm = _lowered(Block(), torch.randn(2, 3, 16))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.rsqrt.default" not in targets and "aten.silu.default" not in targets
    assert "aten.sigmoid.default" in targets and "aten.sqrt.default" in targets
    assert "aten._reshape_copy.default" in targets  # view lowered as Torch-TensorRT does
    assert "aten.linear.default" in targets  # kept whole: Torch-TensorRT converts it


def test_lowering_pass_rewrites_decomposed_graph(trt_rules):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 3, 16)
    gm = _lowered(model, x)
    reports = []
    with fxkern.tensorrt.using(trt_rules, reports.append):
        out = fxkern.tensorrt.lowering_pass(gm, None)
    assert out is gm
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count("fxkern_trt_test.rmsnorm.default") == 1 and ops.count("fxkern_trt_test.swiglu.default") == 1
    assert "aten.sigmoid.default" not in ops and "aten.sqrt.default" not in ops
    assert {m.rule for m in reports[0].matches} == {"rmsnorm", "swiglu"}
    y = torch.randn(2, 3, 16)
    torch.testing.assert_close(gm(y), model(y))


def test_lowering_pass_follows_enable_and_disable(trt_rules):
    model, x = Block().eval(), torch.randn(2, 3, 16)
    try:
        fxkern.tensorrt.disable()
        gm = fxkern.tensorrt.lowering_pass(_lowered(model, x), None)
        assert not any("fxkern_trt_test" in str(n.target) for n in gm.graph.nodes)
        fxkern.tensorrt.enable(trt_rules)
        gm = fxkern.tensorrt.lowering_pass(_lowered(model, x), None)
        assert sum("fxkern_trt_test" in str(n.target) for n in gm.graph.nodes) == 2
    finally:
        fxkern.tensorrt.enable(None)


def test_lowering_pass_on_aot_traced_graph(trt_rules):
    """Torch-TensorRT's torch.compile backend traces with aot_export_joint_simple and the same table."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model, x = Block().eval(), torch.randn(2, 3, 16)
    params = dict(model.named_parameters())

    def f(x):
        return torch.func.functional_call(model, params, (x,))

    with torch.no_grad():
        gm = make_fx(f, decomposition_table=reproduced_table())(x)
    with fxkern.tensorrt.using(trt_rules):
        fxkern.tensorrt.lowering_pass(gm, None)
    assert sum("fxkern_trt_test" in str(n.target) for n in gm.graph.nodes) == 2
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


# ---- availability and import order -----------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("torch_tensorrt") is not None, reason="torch_tensorrt is installed")
def test_available_says_why_not():
    status = fxkern.tensorrt.available()
    assert not status and "torch_tensorrt is not installed" in status.reason and "2.14" in status.reason


@pytest.mark.skipif(importlib.util.find_spec("torch_tensorrt") is not None, reason="torch_tensorrt is installed")
def test_backend_tensorrt_inner_without_tensorrt_is_a_clear_error():
    """Raised when the backend is made: at the first compiled call dynamo wrapped it in its own
    BackendCompilerFailed, which `except fxkern.TensorRTUnavailable` missed (found by a usability test)."""
    for name in ("tensorrt", "torch_tensorrt"):
        with pytest.raises(fxkern.TensorRTUnavailable, match="not installed"):
            fxkern.backend(inner=name)


def test_after_import_hook_runs_whichever_import_comes_first(tmp_path, monkeypatch):
    """The mechanism that makes fxkern/torch_tensorrt import order irrelevant, on a throwaway module."""
    (tmp_path / "fxkern_hook_probe.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    fxkern.tensorrt.after_import("fxkern_hook_probe", lambda: calls.append(sys.modules["fxkern_hook_probe"].VALUE))
    assert calls == []
    assert importlib.util.find_spec("fxkern_hook_probe") is not None  # a probe is not the import
    assert calls == []
    import fxkern_hook_probe  # noqa: F401

    assert calls == [41]
    fxkern.tensorrt.after_import("fxkern_hook_probe", lambda: calls.append("now"))
    assert calls == [41, "now"]
    del sys.modules["fxkern_hook_probe"]


# ---- real TensorRT (skipped here: it cannot be installed on this project's machines) -----------------

needs_trt = pytest.mark.skipif(not fxkern.tensorrt.available(),
                               reason=f"real TensorRT needed: {fxkern.tensorrt.available().reason}")


@needs_trt
@pytest.mark.gpu
@pytest.mark.parametrize("case", seven_cases.CASES, ids=lambda c: c.name)
def test_seven_cases_through_torch_tensorrt(example_ops, case):
    import torch_tensorrt

    args = case.make_inputs(case.shape, torch.float32, "cuda")
    model = seven_cases.CallOp(example_ops[case.name]).cuda()
    trt = torch_tensorrt.compile(model, ir="dynamo", inputs=[a for a in args if isinstance(a, torch.Tensor)],
                                 min_block_size=1)
    engines = [m for m in trt.modules() if type(m).__name__.endswith("TRTModule")]
    assert len(engines) == 1  # the op is a plugin layer in an engine, not a PyTorch fallback
    got, want = trt(*args), case.reference(*args)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@needs_trt
@pytest.mark.gpu
def test_rule_compiles_into_one_engine(trt_rules):
    import torch_tensorrt

    model, x = Block().cuda().eval(), torch.randn(2, 3, 16, device="cuda")
    reports = []
    with fxkern.tensorrt.using(trt_rules, reports.append):
        trt = torch_tensorrt.compile(model, ir="dynamo", inputs=[x], min_block_size=1)
    assert {m.rule for r in reports for m in r.matches} == {"rmsnorm", "swiglu"}  # the pass ran inside
    engines = [m for m in trt.modules() if type(m).__name__.endswith("TRTModule")]
    assert len(engines) == 1
    torch.testing.assert_close(trt(x), model(x), rtol=1e-4, atol=1e-4)
