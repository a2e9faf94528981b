"""replace / rule / RuleSet: creating rules, mapping parameters, and what is refused at creation."""

import pytest
import torch

import fxkern
from fxkern import RuleSet, SpecError
from helpers import Fn, spec_like


def test_replace_registers_the_op_with_the_pattern_as_reference():
    def my_gelu_add(x, b, r):
        return torch.nn.functional.gelu(x + b) + r

    rs = RuleSet("t")
    rule = fxkern.replace(my_gelu_add, spec_like(my_gelu_add), rules=rs)
    assert rule.name == "my_gelu_add" and "my_gelu_add" in rs
    assert rule.op is torch.ops.fxkern.my_gelu_add
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    torch.testing.assert_close(rule.op(x, b, r), my_gelu_add(x, b, r))  # the CPU impl is the pattern
    # and CUDA calls past the kernel's 32-bit sizes run it too: the model ran it before the rewrite
    assert fxkern.kernel_op("fxkern::my_gelu_add").past_limits == "reference"


def test_namespace_from_name():
    def p1(x):
        return torch.tanh(x) * 3

    rule = fxkern.replace(p1, spec_like(p1), name="mylib::tanh3", rules=RuleSet())
    assert rule.op is torch.ops.mylib.tanh3 and rule.name == "tanh3"


def test_decorator_form_and_default_rule_set():
    @fxkern.rule(spec_like(lambda x: x))
    def deco_pattern(x):
        return torch.sin(x) + 1

    assert "deco_pattern" in fxkern.default_rules()
    assert deco_pattern(torch.zeros(1)).item() == 1.0  # the function is returned unchanged
    fxkern.default_rules().remove("deco_pattern")
    assert "deco_pattern" not in fxkern.default_rules()


def test_parameters_map_by_name_else_by_position():
    def named(b, x):  # names agree with the op's, order does not
        return x * b

    spec = spec_like(lambda x, b: x * b)
    rule = fxkern.replace(named, spec, name="named_map", rules=RuleSet())
    assert rule.arg_params == ("x", "b")

    def positional(u, v):
        return u * v

    rule2 = fxkern.replace(positional, rule.op, rules=RuleSet())
    assert rule2.arg_params == ("u", "v")


def test_scalar_parameter_must_map_to_a_scalar_argument():
    def p(x, eps: float):
        return x + eps

    with pytest.raises(SpecError, match="maps to .* argument"):
        fxkern.replace(p, _add_op(), rules=RuleSet())


def _add_op():
    import seven_cases

    return seven_cases.register_all()["add"]


def test_arity_mismatch():
    with pytest.raises(SpecError, match="has 1 parameters but"):
        fxkern.replace(lambda x: x + 1, _add_op(), name="arity", rules=RuleSet())


def two_outputs(x, y):
    return x + y, x * y


@pytest.mark.parametrize("pattern, n_out, words", [
    (lambda x, y: x + y, 2, r"returns 1 tensor\(s\) but"), (two_outputs, 1, r"returns 2 tensor\(s\) but")])
def test_output_count_mismatch_is_refused_by_replace(pattern, n_out, words):
    """It showed only later, site by site, as near-misses (found by a usability test)."""
    spec = spec_like(two_outputs, n_out=n_out)
    with pytest.raises(SpecError, match=words):
        fxkern.replace(pattern, spec, name=f"fxkern_test::outs_{n_out}", rules=RuleSet())


def test_scalar_that_does_not_reach_the_graph_is_refused():
    def p(x, eps: float):
        return x * (1.0 / eps)  # Python arithmetic: eps never appears as a literal

    with pytest.raises(SpecError, match="do not appear as a literal"):
        fxkern.replace(p, spec_like(p), rules=RuleSet())


def test_duplicate_rule_name_in_a_set():
    rs = RuleSet()

    def dup(x):
        return torch.cos(x) * 2

    fxkern.replace(dup, spec_like(dup), name="dup_rule", rules=rs)
    with pytest.raises(SpecError, match="already has a rule named"):
        fxkern.replace(dup, spec_like(dup), name="dup_rule2::dup_rule", rules=rs)


def test_rule_set_is_ordered_and_versioned():
    rs = RuleSet("ordered")
    names = []
    for i in range(3):
        p = _exp_plus(i)
        fxkern.replace(p, spec_like(lambda x: x), rules=rs, example_inputs=[torch.randn(2)])
        names.append(f"order{i}")
    assert [r.name for r in rs] == names and len(rs) == 3
    v = rs.version
    rs.remove("order1")
    assert rs.version > v and [r.name for r in rs] == ["order0", "order2"]


def _exp_plus(i):
    def p(x):
        return torch.exp(x) + i

    p.__name__ = f"order{i}"
    return p


def test_unknown_noise_kind():
    with pytest.raises(SpecError, match="noise"):
        fxkern.replace(lambda x: x * 2, spec_like(lambda x: x), name="noisy", noise=["views", "teleports"], rules=RuleSet())


def test_rule_limited_to_some_irs():
    """irs= keeps a rule out of the IRs it does not name (e.g. out of inductor, where inductor's own
    fusion beats the replacement), and names are checked."""
    import torch.fx as fx

    from fxkern.rewrite import rewrite_graph
    from helpers import spec_like

    def gelu_add(x, y):
        return torch.nn.functional.gelu(x) + y

    rules = fxkern.RuleSet("irs")
    fxkern.replace(gelu_add, spec_like(gelu_add), name="fxkern_test_irs::gelu_add", rules=rules,
                   irs=("export", "aot"))
    x = torch.randn(4, 8)
    ep = torch.export.export(Fn(gelu_add), (x, x))
    assert len(fxkern.explain(ep, rules).matches) == 1
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(gelu_add, tracing_mode="fake")(x, x)
    assert not rewrite_graph(gm.graph, rules, ("inductor",)).matches
    assert len(rewrite_graph(gm.graph, rules, ("aot",)).matches) == 1
    with pytest.raises(fxkern.SpecError, match="irs="):
        fxkern.replace(gelu_add, spec_like(gelu_add), name="fxkern_test_irs::bad", rules=fxkern.RuleSet(),
                       irs=("nope",))
    assert isinstance(gm, fx.GraphModule)


def test_rule_limited_to_some_dtypes():
    """dtypes= tries a rule only at candidates of those dtypes: a bfloat16-only kernel's rule leaves a
    float32 model alone, with no near-miss in the report, and still takes the bfloat16 one."""

    def mish_like(x):
        return x * torch.tanh(torch.nn.functional.softplus(x))

    rules = fxkern.RuleSet("dtypes")
    spec = spec_like(mish_like, dtypes=(torch.bfloat16,))
    fxkern.replace(mish_like, spec, name="fxkern_test_dtypes::mish", rules=rules, dtypes=[torch.bfloat16])
    model, x = Fn(lambda h: mish_like(h) + 1), torch.randn(4, 8)
    report = fxkern.explain(torch.export.export(model, (x,)), rules)
    assert report.matches == [] and report.near_misses == [] and report["mish"].closest is None
    assert len(fxkern.explain(torch.export.export(model.to(torch.bfloat16), (x.bfloat16(),)), rules).matches) == 1
    with pytest.raises(SpecError, match="dtypes="):
        fxkern.replace(mish_like, spec, name="fxkern_test_dtypes::bad", rules=fxkern.RuleSet(), dtypes=["bfloat16"])


def test_one_example_tensor_for_two_parameters_is_refused():
    # Traced once, the pattern would be ``x + x`` and never match ``x + residual``.
    def add_then_exp(x, residual):
        return torch.exp(x + residual)

    t = torch.randn(4)
    with pytest.raises(SpecError, match="'x' and 'residual' are traced with the same example tensor"):
        fxkern.replace(add_then_exp, spec_like(add_then_exp), rules=RuleSet(), example_inputs=[t, t])


def test_example_inputs_as_a_function_of_the_dtype_trace_a_cast_back_per_dtype():
    # A pattern that casts back to its input's dtype holds that dtype in its graph: traced once from fixed
    # example tensors it matches only graphs of their dtype; from a function of the dtype, every dtype.
    def scaled(x, w):
        return w * (x.to(torch.float32) * 2.0).to(x.dtype)

    module = Fn(scaled)
    x, w = torch.randn(4, 8), torch.randn(8)
    all_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cases = (((torch.zeros(3, 8), torch.zeros(8)), {torch.float32}),
             (lambda dt: (torch.zeros(3, 8, dtype=dt), torch.zeros(8, dtype=dt)), set(all_dtypes)))
    for k, (examples, dtypes) in enumerate(cases):
        rules = RuleSet()
        rule = fxkern.replace(scaled, spec_like(scaled, dtypes=all_dtypes), name=f"fxkern_test_examples::scaled_{k}",
                              rules=rules, example_inputs=examples)
        for dtype in all_dtypes:
            ep = torch.export.export(module, (x.to(dtype), w.to(dtype)))
            assert bool(fxkern.explain(ep, rules)[rule.name].matches) == (dtype in dtypes), (k, dtype)


def _ops(graph):
    from fxkern.patterns import is_inert

    return [(n.target, repr(n.args)) for n in graph.nodes if n.op == "call_function" and not is_inert(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_aten_patterns_skip_decomposition_only_where_it_changes_nothing(dtype):
    # Tracing in the core ATen IR skips run_decompositions for a pattern that is already core ATen
    # (most of a first apply's time). Each library pattern traced that way must be the graph that
    # decomposing would have produced, and a pattern with a non-core op must still be decomposed.
    import fxkern.library as lib
    from fxkern import patterns

    skipped = decomposed = 0
    for rule in lib.rules():
        if rule.irs is not None and "core_aten" not in rule.irs:
            continue
        params = patterns.pattern_params(rule.pattern)
        ex = rule.examples(dtype)
        exported = patterns._export_graph(rule.pattern, params, ex, decompose=False)
        fast = patterns._core_aten_graph(rule.pattern, params, ex)
        if all(patterns.keeps_core_op(n.target) for n in exported.nodes if n.op == "call_function"):
            skipped += 1
            assert _ops(fast) == _ops(exported) == _ops(patterns._export_graph(rule.pattern, params, ex, decompose=True)), rule.name
        else:  # RMSNorm's casts, softmax, silu: not core ATen as exported
            decomposed += 1
            assert _ops(fast) != _ops(exported), rule.name
    assert skipped >= 5 and decomposed >= 5  # both paths ran: the GELU forms skip, the norms decompose


def triple(x):
    return x * 3


def triple_kw(x, *, alpha: float):
    return x * alpha


@pytest.mark.parametrize("make, words", [
    (lambda: fxkern.rule(triple), "fxkern.rule takes the op or KernelSpec the pattern becomes"),
    (lambda: fxkern.replace(triple, spec_like(triple), rules=RuleSet("a"), filter=True), "filter= must be a function"),
    (lambda: fxkern.replace(triple, spec_like(triple), rules=RuleSet("b"), priority="high"), "priority= must be an int"),
    (lambda: fxkern.replace(triple, spec_like(triple), rules=[]), "rules= must be a fxkern.RuleSet"),
    (lambda: fxkern.replace(triple_kw, spec_like(triple), rules=RuleSet("c")), "'alpha' is keyword-only"),
    (lambda: fxkern.cuda_kernel_op("fxkern_test::bad_reference", spec_like(triple), reference=42),
     "reference= must be a function"),
], ids=["bare @rule", "filter", "priority", "rules", "keyword-only scalar", "reference"])
def test_a_mistyped_argument_is_refused_where_it_is_given(make, words):
    """Each was accepted and failed later as a raw Python error far from its cause, or (a bare
    @fxkern.rule) registered nothing at all (found by a probe)."""
    with pytest.raises(SpecError, match=words):
        make()


def test_apply_takes_one_rule_and_says_what_rules_are():
    rs = RuleSet("one")
    rule = fxkern.replace(triple, spec_like(triple), rules=rs)
    x = torch.randn(4, 8)
    ep = torch.export.export(Fn(triple), (x,))
    assert len(fxkern.explain(ep, rule).matches) == 1
    with pytest.raises(TypeError, match="rules= takes a fxkern.RuleSet, a list of rules or one rule"):
        fxkern.apply(ep, "default")


def test_a_torch_level_graph_is_refused_with_what_to_do():
    """fx.symbolic_trace's graph holds torch calls, which no ATen pattern matches: explain said
    "0 candidate sites" and apply(verify=True) returned it unchanged (found by a probe)."""
    class Triple(torch.nn.Module):
        def forward(self, x):
            return triple(x)

    gm = torch.fx.symbolic_trace(Triple())
    with pytest.raises(TypeError, match="export the model with torch.export.export"):
        fxkern.explain(gm, RuleSet("empty"))
    ep = torch.export.export(Fn(triple), (torch.randn(4, 8),))
    fxkern.explain(ep.module(), RuleSet("empty"))  # an unlifted export calls its guards as a module: still ATen


def test_the_string_backend_takes_inductors_options():
    """torch.compile(backend="fxkern", options=...) failed: the backend took no options (found by a probe)."""
    f = torch.compile(lambda x: x * 0.5, backend="fxkern", options={"fx_graph_cache": False})
    torch.testing.assert_close(f(torch.ones(4)), torch.full((4,), 0.5))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"\['verfy'\] are not inductor config options"):
        torch.compile(lambda x: x * 0.5, backend="fxkern", options={"verfy": True})(torch.ones(4))
    torch._dynamo.reset()


def test_the_string_backend_takes_a_mode_and_the_backend_checks_its_config_patches():
    """mode= failed with a raw TypeError, and a misspelt config_patches key only at the first call,
    inside dynamo's error (found by a probe)."""
    f = torch.compile(lambda x: x * 0.5, backend="fxkern", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(f(torch.ones(4)), torch.full((4,), 0.5))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"mode='fastest'"):
        torch.compile(lambda x: x * 0.5, backend="fxkern", mode="fastest")(torch.ones(4))
    torch._dynamo.reset()
    with pytest.raises(fxkern.SpecError, match=r"config_patches=...\): \['max_autotun'\] are not inductor config"):
        fxkern.backend(config_patches={"max_autotun": True})


def row_sums(x):
    return x.sum(-1)


def test_a_pattern_computing_another_shape_than_its_op_is_refused_at_registration():
    """An op declaring its output SameAs the input, for a pattern summing rows, registered: every
    match was then refused for the output's shape, and apply did nothing (found by a probe)."""
    with pytest.raises(SpecError, match=r"returns torch.float32 \(4,\) at its example inputs, where .* returns "
                                        r"torch.float32 \(4, 8\)"):
        fxkern.replace(row_sums, spec_like(triple), rules=RuleSet("sums"))


def test_a_rules_traces_per_match_size_are_bounded(monkeypatch):
    """A model compiled for each new sequence length meets new sizes for as long as it serves: the
    traces a rule keeps per match size (``compiled_at``) stay under ``AT_SIZES``, the least recently
    used going first, and a size traced again gives a pattern that matches as the first did."""
    from fxkern import rules as rules_module

    monkeypatch.setattr(rules_module, "AT_SIZES", 3)

    def flat(x):
        return (x * 2).view(x.shape[0], -1)

    rule = fxkern.replace(flat, spec_like(flat), rules=RuleSet("t"), name="t_bounded_flat")
    at = [rule.compiled_at("export", (((n, 4, 2), torch.float32),)) for n in range(1, 8)]
    assert len(rule._at) == 3 and set(rule._at) == {("export", (((n, 4, 2), torch.float32),), ()) for n in (5, 6, 7)}
    assert rule.compiled_at("export", (((5, 4, 2), torch.float32),)) is at[4]  # kept: not traced again
    again = rule.compiled_at("export", (((1, 4, 2), torch.float32),))
    assert again is not at[0] and again == at[0]  # a dataclass: the same nodes, literals and outputs
    assert len(rule._at) == 3 and ("export", (((5, 4, 2), torch.float32),), ()) in rule._at  # 6 went: used least
