"""The CUDA path, on a real GPU (run through tools/gpu_suite.sh on the device).

Every example against its float64 reference on fresh random inputs, with
outputs allocated over poisoned memory so an unwritten element shows up.
"""

import pytest
import torch

import fxkern
import seven_cases
from fxkern import KernelInputError

pytestmark = pytest.mark.gpu

SHAPES = [(1,), (37, 1000), (3, 5, 77), (2, 1025)]  # none a multiple of the block in every axis


@pytest.fixture(scope="module")
def ops():
    return seven_cases.register_all()


def poison():
    """Fill freed allocator blocks with NaN so an output element the kernel skips is visible."""
    big = torch.full((64 << 20,), float("nan"), device="cuda")
    del big


def assert_matches(out, ref, dtype):
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.is_cuda and o.shape == r.shape and o.dtype == r.dtype
        assert not torch.isnan(o).any(), "an output element was never written"
        err = float((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
        assert err <= seven_cases.tolerance(dtype), err


def cases_and_dtypes():
    for case in seven_cases.CASES:
        for dtype in case.dtypes:
            yield pytest.param(case, dtype, id=f"{case.name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("case, dtype", list(cases_and_dtypes()))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_example_matches_reference(ops, case, dtype, shape):
    if case.name == "relu_2d" and len(shape) < 2:
        pytest.skip("relu_2d tiles two axes")
    for _ in range(2):  # fresh inputs each time
        args = case.make_inputs(shape, dtype, "cuda")
        poison()
        out = ops[case.name](*args)
        assert_matches(out, seven_cases.reference_in_float64(case, args), dtype)
    torch.cuda.synchronize()


@pytest.mark.parametrize("case", seven_cases.CASES, ids=lambda c: c.name)
def test_exported_program_runs_the_kernel(ops, case):
    args = case.make_inputs(case.shape, torch.float32, "cuda")
    ep = seven_cases.export_dynamic(case, ops[case.name], args)
    other = case.make_inputs((case.shape[0] + 13, *case.shape[1:]), torch.float32, "cuda")
    assert_matches(ep.module()(*other), seven_cases.reference_in_float64(case, other), torch.float32)


def test_non_contiguous_inputs_are_made_contiguous(ops):
    x = torch.randn(300, 200, device="cuda").t()
    assert not x.is_contiguous()
    torch.testing.assert_close(ops["sigmoid"](x), torch.sigmoid(x))
    torch.testing.assert_close(ops["row_sum"](x), x.sum(-1), rtol=1e-5, atol=1e-4)
    a, b = torch.randn(64, 48, device="cuda")[:, ::2], torch.randn(64, 24, device="cuda")
    torch.testing.assert_close(ops["add"](a, b), a + b)


def test_empty_inputs(ops):
    x = torch.randn(0, 5, device="cuda")
    assert ops["sigmoid"](x).shape == (0, 5)
    s, c = ops["sin_cos"](x)
    assert s.shape == c.shape == (0, 5)
    assert ops["repeat2"](x).shape == (0, 5)
    # a reduction over an empty axis has a real, all-zero result
    torch.testing.assert_close(ops["row_sum"](torch.randn(4, 0, device="cuda")), torch.zeros(4, device="cuda"))
    torch.cuda.synchronize()


def test_an_empty_input_sizes_no_launch(op_name):
    """An empty input launches nothing, so geometry that only makes sense for a real launch (shared
    memory divided by a size that is 0 here) is never evaluated."""
    spec = fxkern.KernelSpec(
        seven_cases.SIGMOID, "sigmoid_kernel", inputs=[fxkern.InputDecl("x")],
        outputs=[fxkern.OutputDecl("y", fxkern.SameAs("x"))], extras=[fxkern.Numel("x")],
        geometry=fxkern.Custom(lambda ins, outs: (fxkern.cdiv(ins[0].numel(), 256), 256, 4096 // ins[0].numel())),
        dtypes=(torch.float32,))
    op = fxkern.cuda_kernel_op(op_name, spec, reference=torch.sigmoid)
    assert op(torch.randn(0, device="cuda")).shape == (0,)
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(op(x), torch.sigmoid(x))
    torch.cuda.synchronize()


def test_scalar_input_values(ops):
    x = torch.randn(1000, device="cuda")
    for alpha in (0.0, -2.5, 1e-3, 3):
        torch.testing.assert_close(ops["scale"](x, alpha), x * alpha)


def test_bad_calls_leave_no_sticky_error(ops):
    x = torch.randn(100, device="cuda")
    with pytest.raises(KernelInputError, match="is on cpu"):
        ops["add"](x, torch.randn(100))
    with pytest.raises(KernelInputError, match="equal shapes"):
        ops["add"](x, torch.randn(99, device="cuda"))
    with pytest.raises(KernelInputError, match="float64"):
        ops["sigmoid"](x.double())
    if torch.cuda.device_count() > 1:
        with pytest.raises(KernelInputError, match="move all tensor inputs to one device"):
            ops["add"](x, torch.randn(100, device="cuda:1"))
    torch.cuda.synchronize()
    torch.testing.assert_close(ops["sigmoid"](x), torch.sigmoid(x))
    torch.cuda.synchronize()


def test_a_call_unlike_the_last_is_checked_afresh(ops):
    """Checks and geometry are worked out once per call signature (shapes, dtypes, devices,
    contiguity): repeats agree with eager, and a call that differs in any of them is checked anew."""
    x = torch.randn(300, 200, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(ops["add"](x, x), x + x)
    t = torch.randn(200, 300, device="cuda").t()  # x's shape, not contiguous: copied first
    torch.testing.assert_close(ops["add"](x, t), x + t)
    with pytest.raises(KernelInputError, match="is on cpu"):
        ops["add"](x, x.cpu())
    with pytest.raises(KernelInputError, match="float64"):
        ops["add"](x.double(), x.double())
    with pytest.raises(KernelInputError, match="equal shapes"):
        ops["add"](x, x[:, :199])
    y = torch.randn(301, 200, device="cuda")  # a new shape gets its own grid
    torch.testing.assert_close(ops["add"](y, y), y + y)
    torch.testing.assert_close(ops["row_sum"](y), y.sum(-1), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops["row_sum"](x), x.sum(-1), rtol=1e-5, atol=1e-4)
    torch.cuda.synchronize()


def test_sizes_past_int32_are_refused_before_launch(ops, op_name):
    """Refused with SizeLimitError (a KernelInputError); an op registered with past_limits="reference"
    runs its reference instead. Either way the kernel still runs the next call."""
    n = 2**31 + 64
    try:
        x = torch.randn(n, dtype=torch.float16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2**31-element tensor")
    with pytest.raises(fxkern.SizeLimitError, match="past the 32-bit int"):
        ops["sigmoid"](x)
    spec = fxkern.kernel_op(ops["sigmoid"]._qualified_op_name).spec
    falls_back = fxkern.cuda_kernel_op(op_name, spec, reference=torch.sigmoid, past_limits="reference")
    assert torch.equal(falls_back(x), torch.sigmoid(x))
    del x
    torch.cuda.synchronize()
    y = torch.randn(10, device="cuda")
    torch.testing.assert_close(ops["sigmoid"](y), torch.sigmoid(y))
    torch.testing.assert_close(falls_back(y), torch.sigmoid(y))


def test_runs_on_the_current_stream(ops):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the side stream busy...
        x = torch.full((1 << 20,), 2.0, device="cuda")  # ...so x is written late on it
        y = ops["scale"](x, 3.0)  # ordered after the fill only if launched on `side`
    side.synchronize()
    assert torch.all(y == 6.0)


def test_launches_from_a_thread_with_no_cuda_context(ops):
    """A new thread (a serving worker) and autograd's backward thread start with no current CUDA
    context; an fxkern launch there may be the thread's first CUDA call, and cuLaunchKernel needs one.
    Both failed with CUDA_ERROR_INVALID_CONTEXT before the launcher bound the device's primary context
    (found by a review, 2026-11-26)."""
    import threading

    x = torch.randn(1000, device="cuda")
    ops["scale"](x, 2.0)  # the module loaded and the call's signature known on the main thread
    torch.cuda.synchronize()
    block = torch.empty(1000, device="cuda")
    del block  # a free block: the worker's output takes it with no runtime call
    got = {}

    def worker():
        from cuda.bindings import driver

        got["context"] = int(driver.cuCtxGetCurrent()[1])  # none: the launch below is the thread's first
        try:
            got["y"] = ops["scale"](x, 3.0)
        except Exception as e:  # reported below, with the thread's error
            got["error"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert got["context"] == 0, "the worker had a CUDA context already: the test no longer reaches the binding"
    assert "error" not in got, got.get("error")
    torch.testing.assert_close(got["y"], x * 3)

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v * 1.0

        @staticmethod
        def backward(ctx, g):
            return ops["scale"](g, 5.0)

    v = torch.randn(1000, device="cuda", requires_grad=True)
    g = torch.randn(1000, device="cuda")
    Scaled.apply(v).backward(g)
    torch.testing.assert_close(v.grad, g * 5)


def test_cuda_graph_capture_and_replay(ops):
    static_x = torch.randn(4096, device="cuda")
    ops["sigmoid"](static_x)  # load the module outside capture
    ops["sin_cos"](static_x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            y = ops["sigmoid"](static_x)
            sn, cs = ops["sin_cos"](y)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        static_x.copy_(torch.randn(4096, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.sigmoid(static_x)
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(sn, torch.sin(ref))
        torch.testing.assert_close(cs, torch.cos(ref))


def test_kernel_is_loaded_once_per_device(ops):
    entry = fxkern.kernel_op(f"{seven_cases.NS}::sigmoid")
    x = torch.randn(10, device="cuda")
    ops["sigmoid"](x)
    from fxkern import compiler

    before = dict(compiler.stats)
    for _ in range(5):
        ops["sigmoid"](x)
    assert compiler.stats == before  # no compile and no cache read on the hot path
    assert entry.plan is not None


@pytest.mark.multi_gpu
def test_op_on_second_gpu_runs_there(ops):
    torch.cuda.set_device(0)
    x = torch.randn(3, 1001, device="cuda:1")
    poison_dev = torch.full((16 << 20,), float("nan"), device="cuda:1")
    del poison_dev
    for case in ("sigmoid", "row_sum", "sin_cos", "relu_2d"):
        c = seven_cases.BY_NAME[case]
        out = ops[case](x)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o.device == x.device for o in outs)
        assert_matches(out, seven_cases.reference_in_float64(c, (x,)), torch.float32)
    side = torch.cuda.Stream(device=1)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        z = torch.full((1 << 20,), 2.0, device="cuda:1")
        y = ops["scale"](z, 3.0)
    side.synchronize()
    assert torch.all(y == 6.0)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)


def test_llama_rmsnorm_rule_runs_the_kernel_in_a_real_model():
    pytest.importorskip("transformers", reason="transformers is not installed")
    import llama_rmsnorm

    assert llama_rmsnorm.main(["--device", "cuda"]) == 0


def _llama_and_rule():
    pytest.importorskip("transformers", reason="transformers is not installed")
    import llama_rmsnorm

    rules = fxkern.RuleSet("gpu-llama")
    rule = fxkern.replace(llama_rmsnorm.llama_rmsnorm, llama_rmsnorm.RMSNORM, name="gpu_test::llama_rmsnorm", rules=rules)
    return llama_rmsnorm.tiny_llama("cuda"), rules, rule


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["default", "cudagraphs"])
def test_backend_with_inductor_on_cuda_runs_the_kernel(cudagraphs):
    """Inductor on CUDA, and with CUDA graphs (what mode="reduce-overhead" turns on)."""
    model, rules, rule = _llama_and_rule()
    torch._dynamo.reset()
    be = fxkern.backend(rules, inner="inductor", config_patches={"triton.cudagraphs": cudagraphs, "fx_graph_cache": False})
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for _ in range(3):  # cudagraph warm-up, record, replay
            ids = torch.randint(0, 256, (2, 32), device="cuda")
            got = compiled(ids, use_cache=False).logits
            want = model(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sum(len(r.matches) for r in be.reports) == 5
    torch._dynamo.reset()


def test_backend_training_on_cuda_gradients_equal_eager():
    model, rules, rule = _llama_and_rule()
    model.train()
    torch._dynamo.reset()
    be = fxkern.backend(rules, inner="inductor", config_patches={"fx_graph_cache": False})
    compiled = torch.compile(model, backend=be)
    ids = torch.randint(0, 256, (2, 32), device="cuda")
    compiled(ids, labels=ids, use_cache=False).loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids, labels=ids, use_cache=False).loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")
    torch._dynamo.reset()


def test_backend_dynamic_shapes_on_cuda_compile_once():
    from torch._dynamo.utils import counters

    model, rules, rule = _llama_and_rule()
    torch._dynamo.reset()
    counters.clear()
    be = fxkern.backend(rules, inner="inductor", config_patches={"fx_graph_cache": False})
    compiled = torch.compile(model, backend=be, dynamic=True)
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):  # keep eps a literal (docs/backends.md)
        for seq in (16, 24, 40):
            ids = torch.randint(0, 256, (2, seq), device="cuda")
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(len(r.matches) for r in be.reports) == 5
    torch._dynamo.reset()


TILE_REVERSE = r"""
#define TILE 25600  // floats: 100 KB of shared memory a block, past the 48 KB a launch gets unasked
extern "C" __global__ void tile_reverse(const float* x, int n, float* y) {
    extern __shared__ float tile[];
    const long long base = (long long)blockIdx.x * TILE;
    const int len = (int)min((long long)TILE, n - base);
    for (int i = threadIdx.x; i < len; i += blockDim.x) tile[i] = x[base + i];
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) y[base + i] = tile[len - 1 - i];
}
"""


def _tile_reverse(name: str, shared_mem: int):
    def geometry(inputs, outputs):
        return (fxkern.cdiv(inputs[0].numel(), 25600),), (256,), shared_mem

    spec = fxkern.KernelSpec(TILE_REVERSE, "tile_reverse", inputs=[fxkern.InputDecl("x")],
                             outputs=[fxkern.OutputDecl("y", fxkern.SameAs("x"))], extras=[fxkern.Numel("x")],
                             geometry=fxkern.Custom(geometry))
    return fxkern.cuda_kernel_op(f"fxkern_test::{name}", spec)


def test_shared_memory_past_48k_is_granted_and_past_the_device_limit_refused():
    op = _tile_reverse("tile_reverse_100k", 25600 * 4)
    x = torch.randn(3 * 25600 + 77, device="cuda")
    want = torch.cat([t.flip(0) for t in x.split(25600)])
    torch.testing.assert_close(op(x), want, rtol=0, atol=0)
    too_much = _tile_reverse("tile_reverse_300k", 300 * 1024)
    with pytest.raises(fxkern.LaunchError, match=r"asks for 307200 bytes of dynamic shared memory.*allows at most"):
        too_much(x)
    torch.cuda.synchronize()  # nothing sticky: the refused launch never ran
    torch.testing.assert_close(op(x), want, rtol=0, atol=0)


def test_a_grid_rounding_down_is_refused_not_returned_unwritten():
    spec = fxkern.KernelSpec(
        'extern "C" __global__ void copy_rd(const float* x, int n, float* y) {\n'
        "    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = x[i]; }",
        "copy_rd", inputs=[fxkern.InputDecl("x")], outputs=[fxkern.OutputDecl("y", fxkern.SameAs("x"))],
        extras=[fxkern.Numel("x")], geometry=fxkern.Custom(lambda ins, outs: ((ins[0].numel() // 256,), (256,))))
    op = fxkern.cuda_kernel_op("fxkern_test::copy_round_down", spec)
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(op(x)[:768], x[:768])  # 3 blocks: the bug shows only in the tail
    with pytest.raises(KernelInputError, match="would be left unwritten"):
        op(torch.randn(100, device="cuda"))
    assert op(torch.randn(0, device="cuda")).shape == (0,)  # empty: no launch, no error
