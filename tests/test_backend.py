"""fxkern.backend: rules inside torch.compile (CPU; the GPU suite repeats it on CUDA)."""

import pytest
import torch
import torch.nn.functional as F

import fxkern
from fxkern import RuleSet
from helpers import count_target, spec_like


def bias_gelu_res(x, b, r):
    return F.gelu(x + b, approximate="tanh") + r


def scale_add(x, r):
    return x * 3 + r  # its backward saves nothing: training graphs can be rewritten too


RULES = RuleSet("backend")
BGR = fxkern.replace(bias_gelu_res, spec_like(bias_gelu_res), name="test_backend::bgr", rules=RULES)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return F.gelu(self.lin(x) + self.b, approximate="tanh") + x


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_callable_inner_receives_the_rewritten_graph():
    seen = []

    def inner(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    model, x = MLP(), torch.randn(4, 8)
    be = fxkern.backend(RULES, inner=inner)
    with torch.no_grad():
        out = torch.compile(model, backend=be)(x)
    torch.testing.assert_close(out, model(x))
    assert count_target(seen[0], BGR.op) == 1
    assert len(be.reports) == 1 and be.reports[0].matches[0].rule == "bgr"


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_inner_backends_compute_what_eager_does(inner):
    model, x = MLP(), torch.randn(4, 8)
    reports = []
    # fx_graph_cache off: on a cache hit inductor skips the passes, so there would be no report
    be = fxkern.backend(RULES, inner=inner, report=reports.append,
                        **({"config_patches": {"fx_graph_cache": False}} if inner == "inductor" else {}))
    with torch.no_grad():
        out = torch.compile(model, backend=be)(x)
    torch.testing.assert_close(out, model(x))
    assert sum(len(r.matches) for r in reports) == 1


def test_training_gradients_equal_eager():
    rs = RuleSet("train")
    rule = fxkern.replace(scale_add, spec_like(scale_add), name="test_backend::scale_add", rules=rs)
    fxkern.replace(bias_gelu_res, BGR.op, name="bgr", rules=rs)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.b = torch.nn.Parameter(torch.randn(8))

        def forward(self, x):
            h = self.lin(x)
            return F.gelu(h + self.b, approximate="tanh") + x * 3 + h

    model = Net()
    seen = []

    def inner(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    x1 = torch.randn(4, 8, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    compiled = torch.compile(model, backend=fxkern.backend(rs, inner=inner))
    compiled(x1).square().sum().backward()
    g_compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for a, p in zip(g_compiled, model.parameters()):
        torch.testing.assert_close(a, p.grad)
    forward = seen[0]
    assert count_target(forward, rule.op) == 1  # nothing of x * 3 is saved for backward
    assert count_target(forward, BGR.op) == 0  # gelu's input is: that match is refused as escaping


def test_dynamic_shapes_compile_once():
    from torch._dynamo.utils import counters

    model = MLP()
    be = fxkern.backend(RULES, inner="aot_eager")
    compiled = torch.compile(model, backend=be, dynamic=True)
    counters.clear()
    with torch.no_grad():
        for n in (3, 5, 9, 17):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(len(r.matches) for r in be.reports) == 1


def test_changing_the_rule_set_recompiles():
    rs = RuleSet("changing")
    model, x = MLP(), torch.randn(4, 8)
    be = fxkern.backend(rs, inner="aot_eager")
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        compiled(x)
        assert sum(len(r.matches) for r in be.reports) == 0
        fxkern.replace(bias_gelu_res, BGR.op, name="bgr", rules=rs)
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert sum(len(r.matches) for r in be.reports) == 1


@pytest.mark.parametrize("inner, train", [("aot_eager", True), ("aot_eager", False), ("inductor", False)])
def test_changing_the_rule_set_after_a_dynamic_compile_keeps_it_dynamic(inner, train):
    """The recompile runs in dynamo's tracing context for the graph: outside it, a dynamic graph was
    specialised to its first example's sizes, and the next size failed (inductor: an assertion;
    training: a size mismatch in backward; found by a review)."""
    rs = RuleSet("changing_dynamic")
    model = MLP()
    options = {"config_patches": {"fx_graph_cache": False}} if inner == "inductor" else {}
    be = fxkern.backend(rs, inner=inner, **options)
    compiled = torch.compile(model, backend=be, dynamic=True)

    def step(n):
        x = torch.randn(n, 8, requires_grad=train)
        with torch.enable_grad() if train else torch.no_grad():
            out, ref = compiled(x), model(x)
            torch.testing.assert_close(out, ref)
            if train:
                torch.testing.assert_close(torch.autograd.grad(out.sum(), [x, model.b]),
                                           torch.autograd.grad(ref.sum(), [x, model.b]))

    step(4)
    fxkern.replace(bias_gelu_res, BGR.op, name="bgr", rules=rs)
    step(5)
    step(6)
    if not train:
        assert sum(len(r.matches) for r in be.reports) >= 1


def test_registered_name_uses_the_default_rule_set():
    fxkern.default_rules().add(BGR)
    try:
        model, x = MLP(), torch.randn(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend="fxkern")(x), model(x))
    finally:
        fxkern.default_rules().remove(BGR.name)


def test_unknown_inner_is_a_clear_error():
    with pytest.raises(Exception, match="inner='tensorrtt' is not supported"):
        with torch.no_grad():
            torch.compile(MLP(), backend=fxkern.backend(RULES, inner="tensorrtt"))(torch.randn(2, 8))


CACHE_SCRIPT = r"""
import sys, torch, torch.nn.functional as F
sys.path[:0] = [{tests!r}]
import fxkern
from torch._dynamo.utils import counters
from test_backend import MLP, RULES
torch.manual_seed(0)
model, x = MLP(), torch.randn(4, 8)
be = fxkern.backend(RULES, inner="inductor")
with torch.no_grad():
    out = torch.compile(model, backend=be)(x)
torch.testing.assert_close(out, model(x))
matches = sum(len(r.matches) for r in be.reports)
print("matches %d hits %d" % (matches, counters["inductor"]["fxgraph_cache_hit"]))
"""


def test_inductor_fx_graph_cache_is_valid_across_processes(tmp_path):
    """The pass's uuid lets inductor cache graphs holding fxkern ops: a second process hits the cache."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "cached.py"
    script.write_text(CACHE_SCRIPT.format(tests=str(Path(__file__).resolve().parent)))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               FXKERN_CACHE_DIR=str(tmp_path / "kernel-cache"))
    first = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stdout
    second = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stdout
    assert first.strip().endswith("matches 1 hits 0")
    assert second.strip().endswith("hits 1")  # the rewritten graph came from the cache


def test_real_model_dynamic_shapes_with_captured_scalars():
    """Under dynamic=True dynamo turns float attributes (RMSNorm's eps) into graph inputs unless
    specialize_float is on; with it on, every norm is replaced in one graph for every length."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import llama_rmsnorm
    from torch._dynamo.utils import counters

    rules = RuleSet("dyn-llama")
    fxkern.replace(llama_rmsnorm.llama_rmsnorm, llama_rmsnorm.RMSNORM, name="test_backend::llama_rms", rules=rules)
    model = llama_rmsnorm.tiny_llama("cpu")
    be = fxkern.backend(rules, inner="aot_eager")
    compiled = torch.compile(model, backend=be, dynamic=True)
    counters.clear()
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        for seq in (16, 24, 40):
            ids = torch.randint(0, 256, (2, seq))
            torch.testing.assert_close(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits)
    assert counters["stats"]["unique_graphs"] == 1
    assert [len(r.matches) for r in be.reports] == [5]


def test_the_cache_key_tells_apart_rules_that_differ_only_in_names_filters_or_kernels(monkeypatch):
    """Inductor's FX graph cache is keyed by the pass's uuid, which holds this key: a pattern edited from
    sin to cos (same bytecode, other names), a rule set differing only in its filter, and an op whose
    spec changed (another process's kernel source) each get another key (the first two reused a cached
    graph; found by a review)."""
    from fxkern.backends.torch_compile import _rule_key
    from fxkern.ops import kernel_op

    def pattern(fn):
        def pat(x, y):
            return fn(x) * y
        return pat

    op = fxkern.cuda_kernel_op("fxkern_test::cache_key_op", spec_like(pattern(torch.sin)))

    def key(fn, filter=None):
        rs = RuleSet("k")
        fxkern.replace(pattern(fn), op, rules=rs, filter=filter)
        return _rule_key(list(rs))

    base = key(torch.sin)
    assert key(torch.sin) == base
    assert len({base, key(torch.cos), key(torch.sin, filter=lambda m: False)}) == 3
    monkeypatch.setattr(kernel_op("fxkern_test::cache_key_op"), "identity", ("another kernel source",))
    assert key(torch.sin) != base


@pytest.mark.parametrize("kwargs, words", [
    (dict(rules="mine"), "rules must be a fxkern.RuleSet"),
    (dict(rules=RuleSet), "rules must be a fxkern.RuleSet"),
    (dict(inner="cudagraphs"), "inner='cudagraphs' is not supported"),
    (dict(inner=3), "inner must be a backend name or a callable"),
    (dict(report="yes"), "report must be a callable"),
    (dict(mode="reduce-overhead"), "unknown option(s) ['mode']"),
    (dict(config_patch={}), "unknown option(s) ['config_patch']"),
])
def test_bad_backend_arguments_are_refused_when_the_backend_is_made(kwargs, words):
    """They surfaced at the first compile as AttributeError/TypeError inside BackendCompilerFailed, or
    were ignored (a misspelt config_patches; found by a review)."""
    with pytest.raises(fxkern.SpecError) as info:
        fxkern.backend(**kwargs)
    assert words in str(info.value)


def test_inductor_rewrites_backward_graphs_too():
    """The rules reach inductor's backward graphs (compiled after the forward's compile returned, where
    a config.patch around it had ended; found by a review): g * cos(x) is sin's backward."""
    def cos_mul(g, x):
        return g * torch.cos(x)

    rules = RuleSet("bwd")
    fxkern.replace(cos_mul, spec_like(cos_mul), name="test_backend::cos_mul", rules=rules)
    counts = []
    be = fxkern.backend(rules, inner="inductor", report=lambda r: counts.append(len(r.matches)),
                        config_patches={"fx_graph_cache": False})
    x = torch.randn(16, requires_grad=True)
    torch.compile(lambda t: torch.sin(t) * 2, backend=be)(x).sum().backward()
    torch._dynamo.reset()
    assert counts == [0, 1]
    torch.testing.assert_close(x.grad, 2 * torch.cos(x))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_torch_cond_branches_are_rewritten_and_analysed_once(inner, monkeypatch):
    """aot_eager hands over the graph holding the branches, inductor each branch and then that graph:
    either way each graph is analysed once (inductor's branches were analysed again from the graph
    holding them) and the true branch's match is replaced once."""
    import fxkern.rewrite

    analysed = []
    real = fxkern.rewrite._analyse
    monkeypatch.setattr(fxkern.rewrite, "_analyse", lambda gm, *a, **k: analysed.append(gm) or real(gm, *a, **k))

    def f(x, b, r, p):
        return torch.cond(p, lambda h, b, r: bias_gelu_res(h, b, r), lambda h, b, r: h - r, (x * 2, b, r)) + 1

    reports = []
    be = fxkern.backend(RULES, inner=inner, report=reports.append,
                        **({"config_patches": {"fx_graph_cache": False}} if inner == "inductor" else {}))
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    compiled = torch.compile(f, backend=be)
    for p in (True, False):
        torch.testing.assert_close(compiled(x, b, r, torch.tensor(p)), f(x, b, r, torch.tensor(p)))
    assert [m.rule for rep in reports for m in rep.matches] == ["bgr"]
    assert len(analysed) == len({id(gm) for gm in analysed}) == 3


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_transposed_match_in_a_cond_branch_keeps_the_branch_compilable(inner):
    """Inductor hands a torch.cond branch to the pass alone and lays its outputs out as their nodes
    say: the op's contiguous result against the other branch's transposed one failed inductor's
    check that both branches return the same strides (InductorError). Such an output is kept."""
    def f(x, b, r):
        xt, rt = x.t(), r.t()
        return torch.cond(x.sum() > 0, lambda xt, b, rt: bias_gelu_res(xt, b, rt), lambda xt, b, rt: xt - rt, (xt, b, rt))

    reports = []
    be = fxkern.backend(RULES, inner=inner, report=reports.append,
                        **({"config_patches": {"fx_graph_cache": False}} if inner == "inductor" else {}))
    compiled = torch.compile(f, backend=be)
    b, r = torch.randn(8), torch.randn(8, 4)
    for x in (torch.randn(8, 4).abs(), -torch.randn(8, 4).abs()):
        out = compiled(x, b, r)
        torch.testing.assert_close(out, f(x, b, r))
        assert out.stride() == f(x, b, r).stride()
    assert not any(rep.matches for rep in reports)
    assert any("would have strides" in nm.reason for rep in reports for nm in rep.near_misses)


def test_a_transposed_match_feeding_a_linear_in_training_is_replaced_under_inductor():
    """The mm after the match saves a transpose of its result for the backward: a value computed
    from the op's result, which inductor lays out as its node says. Only the op's own results
    reaching such an output are held (a review found this match refused)."""
    torch.manual_seed(0)
    w, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, requires_grad=True)

    def f(x, r):
        return bias_gelu_res(x.t(), b, r.t()) @ w

    reports = []
    be = fxkern.backend(RULES, inner="inductor", report=reports.append, config_patches={"fx_graph_cache": False})
    x, r = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    out = torch.compile(f, backend=be)(x, r)
    out.sum().backward()
    grad, x.grad = x.grad.clone(), None
    ref = f(x, r)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, x.grad)
    assert [len(rep.matches) for rep in reports][0] == 1


def test_the_library_through_aot_eager_on_the_demo_model():
    """fxkern.backend(library.rules(), inner="aot_eager") failed on every model: a rule first traced
    inside the compile ran under dynamo's fake mode, which refuses real example tensors (found by a
    review). Now the library's rules trace, match and keep the outputs."""
    import fxkern.library as lib
    from fxkern import demo

    cfg = demo.SIZES["tiny"]
    torch.manual_seed(0)
    model = demo.build_model(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab, (2, 16))
    be = fxkern.backend(lib.rules(), inner="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=be)(ids), model(ids), rtol=1e-4, atol=1e-4)
    assert sum(len(r.matches) for r in be.reports) > 0
