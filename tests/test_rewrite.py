"""apply / explain on exported programs: what is matched, what is refused and why, and that the
rewritten program computes what the original did."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxkern
from fxkern import RuleSet
from fxkern.matcher import index_graph
from fxkern.rewrite import creates_cycle, creates_cycle_networkx, _positions
from helpers import Fn, count_target, export, spec_like

ROOT = Path(__file__).resolve().parents[1]


def bias_gelu_res(x, b, r):
    return F.gelu(x + b, approximate="tanh") + r


def rms(x, w, eps: float):
    v = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(v + eps))


@pytest.fixture(scope="module")
def bgr():
    rs = RuleSet("bgr")
    rule = fxkern.replace(bias_gelu_res, spec_like(bias_gelu_res), rules=rs)
    return rs, rule


@pytest.fixture(scope="module")
def rmsr():
    rs = RuleSet("rms")
    rule = fxkern.replace(rms, spec_like(rms), rules=rs)
    return rs, rule


def run_both(ep, new, *args):
    a, b = ep.module()(*args), new.module()(*args)
    for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(v, u)


def test_commutative_operands_match_either_order(bgr):
    rs, rule = bgr
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    for fn in (
        lambda x, b, r: F.gelu(x + b, approximate="tanh") + r,
        lambda x, b, r: r + F.gelu(b + x, approximate="tanh"),
    ):
        ep = export(Fn(fn), x, b, r)
        new = fxkern.apply(ep, rs, verify=True)
        assert count_target(new, rule.op) == 1
        run_both(ep, new, x, b, r)


def mixed_rotation(x, c, s):
    return x * c + x.flip(-1) * s


@pytest.fixture(scope="module")
def mixed():
    rs = RuleSet("mix")
    return rs, fxkern.replace(mixed_rotation, spec_like(mixed_rotation), rules=rs)


@pytest.mark.parametrize("written", [
    lambda x, c, s: c * x + s * x.flip(-1),
    lambda x, c, s: s * x.flip(-1) + c * x,
    lambda x, c, s: c * x + x.flip(-1) * s,
])
def test_an_operand_order_that_held_is_revisited_when_the_walk_fails_further_on(written, mixed):
    """``c * x`` first binds the pattern's x to c, which holds until ``s * x.flip(-1)`` reads x: the
    walk had backtracked only within the op that failed, so a model writing its tables first (as
    ``cos * x + sin * rotate_half(x)``) was missed (found by a review)."""
    rs, rule = mixed
    args = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    ep = export(Fn(written), *args)
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1
    run_both(ep, new, *args)
    # the flip reads neither input of the first product: no order makes that the pattern
    assert fxkern.explain(export(Fn(lambda x, c, s: c * x + s * (x + 1).flip(-1)), *args), rs)["mixed_rotation"].matches == []


def quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def test_a_differing_literal_of_a_commutative_op_is_named_as_such():
    """``1.7 * x`` against the pattern's ``1.702 * x``: the swapped operand order fails as deep, and its
    reason ("the literal 1.7 where the pattern has tensor 'x'") was the one reported (found by a
    usability test)."""
    rs = RuleSet("qg")
    fxkern.replace(quick_gelu, fxkern.cuda_kernel_op("fxkern_test::quick_gelu_lit", spec_like(quick_gelu)), rules=rs)
    report = fxkern.explain(export(Fn(lambda h: h * torch.sigmoid(1.7 * h)), torch.randn(4, 8)), rs)
    (nm,) = report["quick_gelu"].near_misses
    assert "literal differs" in nm.reason and "1.702" in nm.reason and "1.7" in nm.reason, nm.reason


def l2_normalize(x):
    return F.normalize(x, dim=-1)  # norm(...).clamp_min(eps).expand_as(x): a size list from x's shape


def test_a_size_taken_from_an_input_matches_that_input_in_every_ir():
    """The pattern's expand holds the example input's shape; in core ATen and torch.compile graphs the
    model's expand holds the model's, and the rule matched only in torch.export's IR (found by a
    usability test). The size list now stands for the input's shape, symbolic sizes included."""
    rs = RuleSet("l2")
    op = fxkern.cuda_kernel_op("fxkern_test::l2_normalize", spec_like(l2_normalize), reference=l2_normalize)
    fxkern.replace(l2_normalize, op, rules=rs)
    model, x = Fn(lambda h: F.normalize(h * 2, dim=-1) + 1), torch.randn(2, 5, 16)
    core = export(model, x).run_decompositions()
    assert count_target(fxkern.apply(core, rs, verify=True), op) == 1
    for dynamic in (False, True):
        be = fxkern.backend(rs, inner="aot_eager")
        torch.testing.assert_close(torch.compile(model, backend=be, dynamic=dynamic)(x), model(x))
        torch._dynamo.reset()
        assert [len(r.matches) for r in be.reports] == [1], dynamic


def test_a_report_says_when_no_site_came_close():
    """A hand-written normalize against the F.normalize rule: one div, no walk got halfway, so no
    near-miss; the report said "0 replaced of 1 candidate sites" and nothing else (found by a usability
    test). It says so, and where the closest walk stopped: the model divides by clamp_min itself."""
    rs = RuleSet("l2-close")
    op = fxkern.cuda_kernel_op("fxkern_test::l2_normalize_c", spec_like(l2_normalize), reference=l2_normalize)
    fxkern.replace(l2_normalize, op, rules=rs)
    report = fxkern.explain(export(Fn(lambda h: h / h.norm(dim=-1, keepdim=True).clamp_min(1e-12)), torch.randn(2, 8)), rs)
    assert not report.matches and not report["l2_normalize"].near_misses
    assert "appears 1x, but none of them came close" in str(report)
    assert report["l2_normalize"].closest.reason == "'clamp_min' is aten.clamp_min.default where the pattern has aten.expand_as.default"
    assert "closest    div: 'clamp_min' is aten.clamp_min.default" in str(report)


def test_a_size_that_is_not_the_input_shape_is_refused():
    """Where the graph expands to another shape than the bound input's, the sizes are not "x's shape"."""
    def spread(x):
        return x.sum(-1, keepdim=True).expand_as(x)

    rs = RuleSet("spread")
    fxkern.replace(spread, fxkern.cuda_kernel_op("fxkern_test::spread", spec_like(spread), reference=spread), rules=rs)
    ep = export(Fn(lambda h: h.sum(-1, keepdim=True).expand(2, 5, 16) * 3), torch.randn(1, 5, 16)).run_decompositions()
    report = fxkern.explain(ep, rs)
    assert not report.matches
    (nm,) = report["spread"].near_misses
    assert "the pattern has x's shape, the graph [2, 5, 16]" in nm.reason and "[1, 5, 16]" in nm.reason, nm.reason


def test_one_node_feeds_two_parameters(bgr):
    rs, rule = bgr
    ep = export(Fn(lambda x, b: F.gelu(x + b, approximate="tanh") + x), torch.randn(4, 8), torch.randn(8))
    new = fxkern.apply(ep, rs, verify=True)
    call = next(n for n in new.graph.nodes if n.target == rule.op.default)
    assert call.args[0] is call.args[2]


def test_literal_that_differs_is_a_near_miss_not_a_match(bgr):
    rs, rule = bgr
    ep = export(Fn(lambda x, b, r: F.gelu(x + b) + r), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    (nm,) = report["bias_gelu_res"].near_misses
    assert "literal differs" in nm.reason and "tanh" in nm.reason
    assert count_target(fxkern.apply(ep, rs), rule.op) == 0


def test_report_lists_its_rules_and_names_an_unknown_one(bgr):
    rs, rule = bgr
    report = fxkern.explain(export(Fn(lambda x, b: F.gelu(x + b)), torch.randn(4, 8), torch.randn(8)), rs)
    assert "bias_gelu_res" in report and "rms_norm" not in report
    assert list(report) == [r.name for r in rs]
    with pytest.raises(KeyError, match="no rule named 'rms_norm'.*bias_gelu_res"):
        report["rms_norm"]


def test_captured_scalar_matches_any_value_and_is_passed_on(rmsr):
    rs, rule = rmsr
    w = torch.randn(8)
    for eps in (1e-6, 1e-5, 0.25):
        ep = export(Fn(lambda x, w, eps=eps: rms(x, w, eps)), torch.randn(3, 4, 8), w)
        new = fxkern.apply(ep, rs, verify=True)
        call = next(n for n in new.graph.nodes if n.target == rule.op.default)
        assert call.args[2] == eps


def test_escaping_intermediate_is_refused(bgr):
    rs, rule = bgr

    def fn(x, b, r):
        h = F.gelu(x + b, approximate="tanh")
        return h + r, h * 2  # h is used outside the pattern

    ep = export(Fn(fn), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    assert any("also used by" in nm.reason for nm in report.near_misses)
    assert count_target(fxkern.apply(ep, rs), rule.op) == 0


def test_noise_ops_inside_a_match(bgr):
    rs, rule = bgr

    def fn(x, b, r):
        h = (x + b).clone()
        return F.gelu(h.view(h.shape), approximate="tanh") + r

    ep = export(Fn(fn), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1
    assert not any(n.target == torch.ops.aten.clone.default for n in new.graph.nodes)


def test_a_copy_read_through_is_not_moved_past_an_in_place_write(bgr):
    """A parameter bound through a clone reads the clone's source where the op runs: an in-place write
    to either between the clone and the match would change what it reads, so the match is refused
    (the op read the updated tensor, or lost the write to the clone; found by a review)."""
    rs, rule = bgr

    def saved_then_updated(x, b, r):
        h = x * 1.5
        saved = h.clone()
        h.add_(100.0)
        return F.gelu(saved + b, approximate="tanh") + r, h

    def clone_then_masked(x, b, r):
        h = (x * 1.5).clone()
        h[:, 0] = 0.0
        return F.gelu(h + b, approximate="tanh") + r

    for fn in (saved_then_updated, clone_then_masked):
        args = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
        ep = export(Fn(fn), *args)
        report = fxkern.explain(ep, rs)
        assert any("in-place op" in nm.reason for nm in report.near_misses), (fn.__name__, report)
        new = fxkern.apply(ep, rs)
        run_both(ep, new, *[a.clone() for a in args])

    def unwritten(x, b, r):  # the same clone with no write: still matched, the clone left out
        return F.gelu((x * 1.5).clone() + b, approximate="tanh") + r

    ep = export(Fn(unwritten), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    assert count_target(fxkern.apply(ep, rs, verify=True), rule.op) == 1


def test_an_in_place_write_before_a_later_output_refuses_a_multi_output_match():
    """The anchor is the first output; a second output computed after an in-place write would be
    computed before it by the op (found by a review)."""
    def two(x, y):
        return x * 2.0, x + y

    rs = RuleSet("two")
    rule = fxkern.replace(two, spec_like(two, n_out=2), rules=rs)

    def fn(x, y):
        h = x * 1.0
        a = h * 2.0
        h[0].add_(5.0)
        return a, h + y

    args = (torch.randn(4, 8), torch.randn(4, 8))
    ep = export(Fn(fn), *args)
    assert any("in-place op" in nm.reason for nm in fxkern.explain(ep, rs).near_misses)
    new = fxkern.apply(ep, rs)
    assert count_target(new, rule.op) == 0
    run_both(ep, new, *args)


def test_a_spec_may_declare_the_patterns_parameters_in_another_order():
    """The rule maps arguments by name; the op's CPU reference (the pattern) is called by name too (it
    computed pattern(x=y, y=x); found by a review)."""
    def sub_scale(x, y):
        return (x - y) * 2.0

    src = 'extern "C" __global__ void ksub_yx(const float* y, const float* x, int n, float* out) {}'
    spec = fxkern.KernelSpec(src, "ksub_yx", inputs=[fxkern.InputDecl("y"), fxkern.InputDecl("x")],
                             outputs=[fxkern.OutputDecl("out", fxkern.SameAs("x"))], extras=[fxkern.Numel("x")],
                             geometry=fxkern.Elementwise())
    rs = RuleSet("yx")
    rule = fxkern.replace(sub_scale, spec, rules=rs, name="fxkern_test::sub_scale_yx")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(rule.op(y, x), (x - y) * 2.0)
    ep = export(Fn(lambda x, y: (x - y) * 2.0), x, y)
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1
    run_both(ep, new, x, y)


def count_nested(program, op):
    """Calls of ``op`` in the program's graph and in every subgraph its higher-order ops run."""
    gm = program.graph_module if hasattr(program, "graph_module") else program
    return sum(1 for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.target == op.default)


class NoGrad(torch.nn.Module):
    def forward(self, x, b, r):
        with torch.no_grad():
            y = F.gelu(x + b, approximate="tanh") + r
        return y * 2


class AutocastOff(torch.nn.Module):  # as transformers' rotary embeddings compute cos and sin
    def forward(self, x, b, r):
        with torch.autocast("cpu", enabled=False):
            y = F.gelu(x + b, approximate="tanh") + r
        return y * 2


class Nested(torch.nn.Module):
    def forward(self, x, b, r):
        y = F.gelu(x + b, approximate="tanh") + r
        with torch.no_grad():
            with torch.autocast("cpu", enabled=False):
                z = F.gelu(y + b, approximate="tanh") + r
        return z


class Cond(torch.nn.Module):
    def forward(self, x, b, r):
        return torch.cond(x.sum() > 0, lambda x, b, r: F.gelu(x + b, approximate="tanh") + r,
                          lambda x, b, r: x - r, (x, b, r))


@pytest.mark.parametrize("model,replaced,block", [
    (NoGrad(), 1, "a torch.no_grad() block"),
    (AutocastOff(), 1, "a torch.autocast block"),
    (Nested(), 2, "a torch.autocast block in a torch.no_grad() block"),
    (Cond(), 1, "a torch.cond branch"),
])
def test_a_match_inside_a_no_grad_autocast_or_cond_block_is_rewritten(bgr, model, replaced, block, tmp_path):
    """torch.export keeps such blocks as higher-order ops over submodules (``wrap_with_set_grad_enabled``,
    ``wrap_with_autocast``, ``cond``); matches inside are rewritten in a copy of the submodule, and
    the original program keeps its own."""
    rs, rule = bgr
    args = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    ep = torch.export.export(model, args)
    report = fxkern.explain(ep, rs)
    assert len(report.matches) == replaced
    inner = next(m for m in report.matches if "." in m.nodes[0])
    assert inner.location.endswith(f"in {block}")
    assert "test_rewrite.py:" in inner.location or isinstance(model, Cond)  # a branch's trace is of its own graph
    assert inner.nodes[0].startswith("true_graph_0." if isinstance(model, Cond) else "submod_1.")
    new = fxkern.apply(ep, rs, verify=True)
    assert count_nested(new, rule.op) == replaced
    assert count_nested(ep, rule.op) == 0
    run_both(ep, new, *args)
    if isinstance(model, Cond):  # the other branch
        run_both(ep, new, -args[0].abs() - 1, args[1], args[2])
    torch.export.save(new, tmp_path / "new.pt2")
    loaded = torch.export.load(tmp_path / "new.pt2")
    assert count_nested(loaded, rule.op) == replaced
    run_both(ep, loaded, *args)


def mm_scale(x, w):
    return torch.matmul(x, w) * 2.0


def test_inside_an_enabled_autocast_block_a_match_is_refused_where_autocast_changes_an_op():
    """Autocast runs a float32 matmul in bfloat16 there; the op would run it as written. Given
    bfloat16 inputs, autocast changes nothing and the match is replaced."""
    rs = RuleSet("mm")
    rule = fxkern.replace(mm_scale, spec_like(mm_scale, dtypes=(torch.float32, torch.bfloat16)), rules=rs,
                          example_inputs=lambda dt: (torch.randn(8, 8, dtype=dt), torch.randn(8, 8, dtype=dt)))

    class Model(torch.nn.Module):
        def forward(self, x, w):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.matmul(x, w) * 2.0
            return y

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    ep = torch.export.export(Model(), (x, w))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    assert any("torch.autocast('cpu')" in nm.reason and "matmul" in nm.reason for nm in report.near_misses)
    assert count_nested(fxkern.apply(ep, rs), rule.op) == 0

    xb, wb = x.bfloat16(), w.bfloat16()
    ep = torch.export.export(Model(), (xb, wb))
    new = fxkern.apply(ep, rs, verify=True)
    assert count_nested(new, rule.op) == 1
    run_both(ep, new, xb, wb)


def test_what_cuda_autocast_changes_is_read_from_the_traced_dtypes(rmsr):
    """Under CUDA autocast ``pow``, ``rsqrt`` and ``sum`` are float32-list ops: given float32 inputs
    (an RMSNorm that upcasts first) they run as written; a bfloat16 ``sum`` traced to float32 did not."""
    from fxkern.rewrite import _autocast_changes

    ep = export(Fn(lambda x, w: rms(x.float(), w, 1e-6)), torch.randn(4, 8), torch.randn(8))
    ops = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert {n.target for n in ops} >= {torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.rsqrt.default}
    assert not any(_autocast_changes(n) for n in ops)

    ep = export(Fn(lambda x: x.pow(2).sum(-1)), torch.randn(4, 8, dtype=torch.bfloat16))
    total = next(n for n in ep.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList)
    assert not _autocast_changes(total)
    total.meta["val"] = total.meta["val"].float()  # as CUDA autocast traces it
    assert _autocast_changes(total)


def mm_cast(x, w):
    return torch.matmul(x, w).to(x.dtype) * 2.0


def es_cast(x, w):
    return torch.einsum("ij,jk->ik", x, w).to(x.dtype) * 2.0


def as_written(name, pattern):
    """What a kernel does under autocast: runs as written (autocast has no kernel for the op)."""
    @torch.library.custom_op(f"fxkern_test::{name}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return pattern(x, w)

    op.register_fake(lambda x, w: x.new_empty(x.shape[0], w.shape[1]))
    return getattr(torch.ops.fxkern_test, name)


MM_AS_WRITTEN = as_written("mm_as_written", mm_cast)
ES_AS_WRITTEN = as_written("es_as_written", es_cast)


class CondInAutocast(torch.nn.Module):  # export keeps this block as inline _enter/_exit_autocast nodes
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.cond(x.sum() > -1e9, lambda x, w: torch.matmul(x, w).to(x.dtype) * 2.0,
                              lambda x, w: x - w, (x, w))


class BesideCondInAutocast(torch.nn.Module):
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.matmul(x, w).to(x.dtype) * 2.0
            return torch.cond(x.sum() > -1e9, lambda y: y + 1, lambda y: y - 1, (y,))


class EinsumInAutocast(torch.nn.Module):
    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.einsum("ij,jk->ik", x, w).to(x.dtype) * 2.0
        return y


@pytest.mark.parametrize("model", [CondInAutocast(), BesideCondInAutocast(), EinsumInAutocast()],
                         ids=["cond in the block", "beside a cond", "composite op"])
def test_autocast_that_changes_an_op_refuses_the_match_wherever_export_puts_the_block(model):
    """A block holding a torch.cond exports as inline _enter/_exit_autocast nodes, not a
    wrap_with_autocast subgraph, and the check missed it; einsum has no autocast kernel of its own,
    but the matmul it becomes does. Both were replaced, a wrong result (found by a review)."""
    einsum = isinstance(model, EinsumInAutocast)
    rs = RuleSet("as_written")
    fxkern.replace(es_cast if einsum else mm_cast, ES_AS_WRITTEN if einsum else MM_AS_WRITTEN, rules=rs,
                   example_inputs=lambda dt: (torch.randn(8, 8, dtype=dt), torch.randn(8, 8, dtype=dt)))
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    ep = torch.export.export(model, (x, w))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    assert any("torch.autocast('cpu')" in nm.reason for nm in report.near_misses), str(report)
    torch.testing.assert_close(fxkern.apply(ep, rs, verify=True).module()(x, w), ep.module()(x, w))


def test_rewriting_a_programs_module_in_place_leaves_the_program_as_it_was(bgr):
    """ep.module() shares its subgraphs with the program: rewriting them in place rewrote the
    ExportedProgram too (found by a review). Subgraphs are rewritten in copies."""
    rs, rule = bgr
    args = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    ep = torch.export.export(Nested(), args)
    gm = ep.module()
    assert fxkern.apply(gm, rs, inplace=True) is gm and count_nested(gm, rule.op) == 2
    assert count_nested(ep, rule.op) == 0 and count_nested(ep.module(), rule.op) == 0
    torch.testing.assert_close(gm(*args), ep.module()(*args))


def times3_plus(x, r):
    return x * 3 + r


@pytest.fixture(scope="module")
def layouts():
    """Two ops for ``x * 3 + r``: one writing a contiguous result, one (its meta_fn) a transposed one."""
    rs, cols = RuleSet("layouts"), RuleSet("layouts_cols")
    rows = fxkern.replace(times3_plus, spec_like(times3_plus), name="test_rewrite::t3p_rows", rules=rs)

    def transposed(x, r):
        return torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype, device=x.device)

    col_op = fxkern.cuda_kernel_op("test_rewrite::t3p_cols", spec_like(times3_plus), meta_fn=transposed,
                                   reference=times3_plus)
    fxkern.replace(times3_plus, col_op, name="t3p_cols", rules=cols)
    return rs, rows, cols


def test_the_op_node_carries_the_ops_layout(layouts):
    """eager's elementwise ops keep a transposed input's layout; the op writes rows. The new node's
    value says so: the old one, copied, claimed a transposed result."""
    rs, rows, _ = layouts
    model = Fn(lambda x, r: (x.t() * 3 + r.t()).sum(0))
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(model, args)
    new = fxkern.apply(ep, rs)
    (node,) = [n for n in new.graph.nodes if n.target == rows.op.default]
    assert node.meta["val"].stride() == (4, 1)
    torch.testing.assert_close(new.module()(*args), ep.module()(*args))
    torch.testing.assert_close(new.run_decompositions().module()(*args), ep.module()(*args))


@pytest.mark.parametrize("after", [lambda y: y.view(24), lambda y: (y * 2).view(24), lambda y: y.as_strided((6,), (1,)),
                                   lambda y: y.split(2, 0)[0].view(12)],
                         ids=["view", "view after a mul", "as_strided", "view of a split"])
def test_a_layout_that_breaks_a_later_view_refuses_the_match(layouts, after):
    """The graph's view of a contiguous result, taken directly or after a mul or a split (which keep
    their input's layout), is no view of the transposed one the op writes: the program crashed when
    run; as_strided would read other elements. An elementwise use takes either layout."""
    _, _, cols = layouts
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(Fn(lambda x, r: after(x * 3 + r) + 1), args)
    report = fxkern.explain(ep, cols)
    assert not report.matches and any("would have strides (1, 4) where the graph has (6, 1)" in nm.reason
                                      for nm in report.near_misses), str(report)
    torch.testing.assert_close(fxkern.apply(ep, cols).module()(*args), ep.module()(*args))


class NoGradAfter(torch.nn.Module):
    def forward(self, x, r):
        y = x * 3 + r
        with torch.no_grad():
            z = y * 2
        return z + 1


def test_a_layout_a_higher_order_op_takes_either_way_is_replaced(layouts):
    """A no_grad block using the result holds no view: the match is replaced (a review found every
    higher-order op user refused)."""
    _, _, cols = layouts
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(NoGradAfter(), args)
    assert len(fxkern.explain(ep, cols).matches) == 1
    torch.testing.assert_close(fxkern.apply(ep, cols).module()(*args), ep.module()(*args))


def test_a_layout_no_later_node_depends_on_is_replaced(layouts):
    _, _, cols = layouts
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(Fn(lambda x, r: ((x * 3 + r) * 2).t().reshape(24) + 1), args)
    assert len(fxkern.explain(ep, cols).matches) == 1
    torch.testing.assert_close(fxkern.apply(ep, cols).module()(*args), ep.module()(*args))


def mean_center(x):
    return x - x.sum(-1, keepdim=True) / x.shape[-1]


@pytest.fixture(scope="module")
def centered():
    rs = RuleSet("sized")
    fxkern.replace(mean_center, spec_like(mean_center), rules=rs)
    return rs


@pytest.mark.parametrize("width, divisor, replaced", [(16, "size", True), (5, "size", True), (8, 8, True),
                                                      (16, 8, False)])
def test_numbers_a_pattern_computes_from_sizes_match_the_inputs_sizes(centered, width, divisor, replaced):
    """``x.shape[-1]`` traces to the example's 8. As a literal, it matched a model dividing by a
    constant 8 at rows of 16, where the op divides by 16 (found by a probe), and missed rows of 5.
    It now matches any number, and the pattern is traced again at the match's sizes to check it."""
    model = Fn(lambda x: x - x.sum(-1, keepdim=True) / (x.shape[-1] if divisor == "size" else divisor))
    x = torch.randn(3, width)
    ep = torch.export.export(model, (x,))
    report = fxkern.explain(ep, centered)
    assert len(report.matches) == int(replaced), str(report)
    if not replaced:
        assert "the graph's numbers are not those it computes" in report.near_misses[0].reason
    torch.testing.assert_close(fxkern.apply(ep, centered).module()(x), model(x))


@pytest.mark.parametrize("model, dims, replaced", [
    (Fn(lambda x: x - x.sum(-1, keepdim=True) / 8), {1: torch.export.Dim("d", min=2, max=64)}, False),
    (Fn(lambda x: x - x.sum(-1, keepdim=True) / 8), {0: torch.export.Dim("b", min=2, max=64)}, True),
    (Fn(lambda x: x - x.sum(-1, keepdim=True) / x.shape[-1]), {0: torch.export.Dim("b", min=2, max=64)}, True),
], ids=["constant at a symbolic width", "constant at a symbolic batch", "size at a symbolic batch"])
def test_numbers_computed_from_sizes_at_symbolic_sizes(centered, model, dims, replaced):
    """A symbolic size is traced at its example value and at twice it: the width the number comes
    from refuses a constant, a batch it does not come from is no reason to refuse (a review found
    every symbolic size refused, so torch.compile's dynamic recompile dropped the match)."""
    ep = torch.export.export(model, (torch.randn(3, 8),), dynamic_shapes=((dims,),))
    report = fxkern.explain(ep, centered)
    assert len(report.matches) == int(replaced), str(report)
    if not replaced:
        assert "other values of its symbolic size" in report.near_misses[0].reason
    for shape in ((3, 8), (3, 16)) if 1 in dims else ((5, 8), (2, 8)):
        y = torch.randn(shape)
        torch.testing.assert_close(fxkern.apply(ep, centered).module()(y), model(y))


def two_means(a, b):
    return a.sum(-1) / a.shape[-1] + b.sum(-1) / b.shape[-1]


def test_numbers_from_sizes_keep_each_input_in_its_place():
    """A / 4 + B / 16 with A of 16 columns and B of 4: at these sizes the pattern matches with its
    add's operands swapped, and the op computed A / 16 + B / 4 (found by a review)."""
    rs = RuleSet("two_means")
    op = fxkern.cuda_kernel_op("test_rewrite::two_means", spec_like(two_means), reference=two_means,
                               meta_fn=lambda a, b: a.new_empty(a.shape[:-1]))
    fxkern.replace(two_means, op, rules=rs, example_inputs=(torch.randn(4, 8), torch.randn(4, 6)))
    model = Fn(lambda a, b: a.sum(-1) / 4 + b.sum(-1) / 16)
    args = (torch.randn(3, 16), torch.randn(3, 4))
    ep = torch.export.export(model, args)
    assert not fxkern.explain(ep, rs).matches
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(*args), model(*args))
    fair = Fn(lambda a, b: a.sum(-1) / 16 + b.sum(-1) / 4)
    assert len(fxkern.explain(torch.export.export(fair, args), rs).matches) == 1
    torch.testing.assert_close(fxkern.apply(torch.export.export(fair, args), rs).module()(*args), fair(*args))


def test_an_example_dim_of_one_counts_as_a_size():
    """Given a (1, 8) example, ``x.shape[0]`` traced to 1, and a model dividing by a constant 1 at 4
    rows was replaced (found by a review): dims of 1 are doubled too where the trace allows."""
    def col_center(x):
        return x - x.sum(0, keepdim=True) / x.shape[0]

    rs = RuleSet("col_center")
    fxkern.replace(col_center, spec_like(col_center), rules=rs, example_inputs=(torch.randn(1, 8),))
    model = Fn(lambda x: x - x.sum(0, keepdim=True) / 1)
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,))
    assert not fxkern.explain(ep, rs).matches
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(x), model(x))


class TransposedCond(torch.nn.Module):
    def forward(self, x, b, r):
        xt, rt = x.t(), r.t()
        return torch.cond(x.sum() > 0, lambda xt, b, rt: F.gelu(xt + b, approximate="tanh") + rt,
                          lambda xt, b, rt: xt - rt, (xt, b, rt))


def test_a_cond_branch_keeps_its_output_strides(bgr):
    """Both branches must return the same strides: a transposed result replaced by the op's
    contiguous one broke run_decompositions() and re-export (found by a review)."""
    rs, rule = bgr
    args = (torch.randn(8, 4), torch.randn(8), torch.randn(8, 4))
    ep = torch.export.export(TransposedCond(), args)
    report = fxkern.explain(ep, rs)
    assert not report.matches and any("strides" in nm.reason for nm in report.near_misses), str(report)
    new = fxkern.apply(ep, rs)
    torch.testing.assert_close(new.run_decompositions().module()(*args), ep.module()(*args))


class TransposedCondSum(torch.nn.Module):
    def forward(self, x, b, r):
        xt, rt = x.t(), r.t()
        return torch.cond(x.sum() > 0, lambda xt, b, rt: (F.gelu(xt + b, approximate="tanh") + rt).sum(1),
                          lambda xt, b, rt: xt.sum(1), (xt, b, rt))


def test_a_cond_branch_result_that_does_not_leave_the_branch_may_change_layout(bgr):
    """Only what a branch returns must keep its strides: a transposed match summed inside the
    branch was refused too."""
    rs, rule = bgr
    args = (torch.randn(8, 4), torch.randn(8), torch.randn(8, 4))
    ep = torch.export.export(TransposedCondSum(), args)
    assert len(fxkern.explain(ep, rs).matches) == 1
    new = fxkern.apply(ep, rs)
    assert count_nested(new, rule.op) == 1
    for x in (args[0], -args[0].abs()):
        torch.testing.assert_close(new.run_decompositions().module()(x, *args[1:]), ep.module()(x, *args[1:]))


def gelu_bias_ref(x, b):
    return F.gelu(x + b, approximate="tanh")


GELU_BIAS_OP = fxkern.cuda_kernel_op("fxkern_test::rewrite_region_gelu_bias", spec_like(gelu_bias_ref),
                                     reference=gelu_bias_ref)


class RegionAroundNoGrad(torch.nn.Module):
    def forward(self, x, b):
        with fxkern.region(GELU_BIAS_OP):
            with torch.no_grad():
                y = x + b
            y = F.gelu(y, approximate="tanh")
        return y * 2


def test_the_part_of_a_region_inside_a_no_grad_block_is_no_run_of_it():
    """``x + b`` in the no_grad subgraph has the op's arity: it was replaced by the whole region's
    op, and GELU ran twice (found by a review). Regions are found in the program's graph only."""
    args = (torch.randn(4, 8), torch.randn(8))
    ep = torch.export.export(RegionAroundNoGrad(), args)
    new = fxkern.apply(ep, RuleSet("empty"))
    assert count_nested(new, GELU_BIAS_OP) == 0
    torch.testing.assert_close(new.module()(*args), ep.module()(*args))


def test_a_subgraph_of_another_higher_order_op_is_reported_not_rewritten(bgr):
    """A map_impl body (torch's control-flow map) runs per slice: its match is a near-miss."""
    from torch._higher_order_ops.map import map as hop_map
    rs, rule = bgr

    class Mapped(torch.nn.Module):
        def forward(self, xs, b, r):
            return hop_map(lambda x, b, r: F.gelu(x + b, approximate="tanh") + r, xs, b, r)

    ep = torch.export.export(Mapped(), (torch.randn(3, 4, 8), torch.randn(8), torch.randn(4, 8)))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    assert any("does not rewrite" in nm.reason for nm in report.near_misses), str(report)
    assert count_nested(fxkern.apply(ep, rs), rule.op) == 0


def test_casts_are_not_noise_by_default_but_can_be():
    def gelu_res(x, r):
        return F.gelu(x) + r

    strict, loose = RuleSet(), RuleSet()
    fxkern.replace(gelu_res, spec_like(gelu_res), rules=strict)
    fxkern.replace(gelu_res, torch.ops.fxkern.gelu_res, rules=loose, noise=["views", "clones", "casts"])
    ep = export(Fn(lambda x, r: F.gelu(x).to(torch.float32) + r), torch.randn(4, 8), torch.randn(4, 8))
    assert count_target(fxkern.apply(ep, strict), torch.ops.fxkern.gelu_res) == 0
    assert count_target(fxkern.apply(ep, loose, verify=True), torch.ops.fxkern.gelu_res) == 1


def test_llama_rmsnorm_with_upcast_used_by_the_residual():
    """Llama's RMSNorm on float32: the `to(float32)` at the match's edge is also returned (the residual)."""

    def llama_rms(hidden, weight, eps: float):
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        var = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(var + eps)
        return weight * hidden.to(dtype)

    rs = RuleSet()
    rule = fxkern.replace(llama_rms, spec_like(llama_rms), rules=rs)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8))

        def forward(self, x, r):
            h = x + r
            hf = h.to(torch.float32)
            var = hf.pow(2).mean(-1, keepdim=True)
            normed = self.weight * (hf * torch.rsqrt(var + 1e-6)).to(x.dtype)
            return normed, hf  # the upcast value is also the residual stream

    ep = export(Block(), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1


def test_dynamic_shapes_stay_symbolic(bgr):
    rs, rule = bgr
    batch = torch.export.Dim.DYNAMIC  # (named Dims hit a torch 2.11 bug in its own error formatting)
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8),
                dynamic_shapes=((({0: batch}), None, {0: batch}),))
    new = fxkern.apply(ep, rs, verify=True)
    call = next(n for n in new.graph.nodes if n.target == rule.op.default)
    assert isinstance(call.meta["val"].shape[0], torch.SymInt)
    x, b, r = torch.randn(37, 8), torch.randn(8), torch.randn(37, 8)
    run_both(ep, new, x, b, r)


def test_multi_output_pattern():
    def add_rms(x, r, w, eps: float):
        h = x + r
        v = h.pow(2).mean(-1, keepdim=True)
        return w * (h * torch.rsqrt(v + eps)), h

    rs = RuleSet()
    rule = fxkern.replace(add_rms, spec_like(add_rms, n_out=2), rules=rs)

    def fn(x, r, w):
        h = x + r
        normed = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
        return torch.tanh(normed), h * 3

    ep = export(Fn(fn), torch.randn(4, 8), torch.randn(4, 8), torch.randn(8))
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1
    run_both(ep, new, torch.randn(4, 8), torch.randn(4, 8), torch.randn(8))


def test_overlap_goes_to_priority_then_size():
    def gelu_only(x):
        return F.gelu(x, approximate="tanh")

    rs = RuleSet()
    small = fxkern.replace(gelu_only, spec_like(gelu_only), rules=rs)
    big = fxkern.replace(bias_gelu_res, spec_like(bias_gelu_res), name="bgr_big", rules=rs)
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    # default priority: the order rules were added, so the first rule wins the overlap
    assert [m.rule for m in report.matches] == ["gelu_only"]
    assert any(nm.reason == "overlap lost to rule 'gelu_only'" for nm in report["bgr_big"].near_misses)
    big.priority = -1
    assert [m.rule for m in fxkern.explain(ep, rs).matches] == ["bgr_big"]
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, big.op) == 1 and count_target(new, small.op) == 0


def test_filter_declines(bgr):
    rs = RuleSet()
    fxkern.replace(bias_gelu_res, torch.ops.fxkern.bias_gelu_res, name="filtered", rules=rs,
                   filter=lambda m: m.bindings["x"].meta["val"].shape[-1] > 8)
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches and report.near_misses[0].reason == "the rule's filter declined it"


def test_op_that_refuses_the_inputs_is_not_used(bgr):
    rs, rule = bgr  # a float32-only kernel
    args = (torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    ep = export(Fn(bias_gelu_res), *args)
    report = fxkern.explain(ep, rs)
    assert not report.matches and "refuses these inputs" in report.near_misses[0].reason


def test_non_convex_match_is_refused():
    def two_muls(x, y):
        return (x * 2) * y

    rs = RuleSet()
    fxkern.replace(two_muls, spec_like(two_muls), rules=rs)

    def fn(x):
        a = x * 2
        c = torch.relu(a)  # a path out of the match...
        return a * c  # ...and back into it

    ep = export(Fn(fn), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    assert any("cycle" in nm.reason or "also used by" in nm.reason for nm in report.near_misses)


class Diamond(torch.nn.Module):
    def forward(self, x):
        a = x * 2
        c = torch.relu(a)
        return a * c


def test_cycle_check_agrees_with_networkx():
    gm = torch.fx.symbolic_trace(Diamond())
    nodes = {n.name: n for n in gm.graph.nodes}
    pos = _positions(gm.graph)
    bad = {nodes["mul"], nodes["mul_1"]}
    good = {nodes["relu"], nodes["mul_1"]}
    assert creates_cycle(bad, pos) is not None and creates_cycle_networkx(gm.graph, bad)
    assert creates_cycle(good, pos) is None and not creates_cycle_networkx(gm.graph, good)


def test_core_aten_graphs_match_too(rmsr):
    rs, rule = rmsr
    ep = export(Fn(lambda x, w: rms(x, w, 1e-6)), torch.randn(4, 8), torch.randn(8)).run_decompositions()
    assert count_target(fxkern.apply(ep, rs, verify=True), rule.op) == 1


def test_graph_module_input(bgr):
    rs, rule = bgr
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    gm = ep.module()
    new = fxkern.apply(gm, rs)
    assert isinstance(new, torch.fx.GraphModule) and count_target(new, rule.op) == 1


def test_a_graph_module_keeps_its_inputs_and_outputs_structure(bgr):
    """``ep.module()`` takes and returns what the model did (here a dict, and keyword arguments): the
    rewritten copy too (it returned a tuple before its code generator was copied)."""
    rs, rule = bgr

    class Named(torch.nn.Module):
        def forward(self, x, b, *, r):
            return {"out": bias_gelu_res(x, b, r), "x": x * 2}

    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    gm = torch.export.export(Named(), (x, b), {"r": r}).module()
    new = fxkern.apply(gm, rs, verify=True)
    assert count_target(new, rule.op) == 1
    got, want = new(x, b, r=r), Named()(x, b, r=r)
    assert isinstance(got, dict) and got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k])


def test_verify_catches_a_wrong_rewrite():
    def wrong_reference(x, b, r):
        return F.gelu(x + b, approximate="tanh") - r  # not what the pattern computes

    spec = spec_like(bias_gelu_res)
    op = fxkern.cuda_kernel_op("fxkern_test::wrong_bgr", spec, reference=wrong_reference)
    rs = RuleSet()
    fxkern.replace(bias_gelu_res, op, name="wrong", rules=rs)
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    with pytest.raises(fxkern.VerificationError, match="output 0 .* changed"):
        fxkern.apply(ep, rs, verify=True)


def _wrong_past_two(x, b, r):
    """bias_gelu_res, but wrong where x's first element is past 2 (about 2% of standard normal draws)."""
    right = F.gelu(x + b, approximate="tanh") + r
    return right + (x.reshape(-1)[0] > 2).to(x.dtype)


@pytest.fixture(scope="module")
def wrong_past_two():
    return fxkern.cuda_kernel_op("fxkern_test::wrong_past_two", spec_like(bias_gelu_res), reference=_wrong_past_two)


@pytest.mark.parametrize("kind", ["program", "graph_module"])
def test_verify_with_several_samples_catches_an_op_wrong_only_for_some_values(wrong_past_two, wrong_bgr, kind):
    """verify=N draws N random inputs: an op wrong for a few values passes one draw and fails among
    many, and the error says which draw found it. Seeded: the first draw misses, a later one hits."""
    op = wrong_past_two
    rs = RuleSet()
    fxkern.replace(bias_gelu_res, op, name="sometimes_wrong", rules=rs)
    ep = export(Fn(bias_gelu_res), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    program = ep if kind == "program" else ep.module()
    torch.manual_seed(0)
    assert count_target(fxkern.apply(program, rs, verify=True), op) == 1  # one draw: passes
    torch.manual_seed(0)
    with pytest.raises(fxkern.VerificationError, match=r"random sample (\d+) of 200; the ones before it passed"):
        fxkern.apply(program, rs, verify=200)
    for bad, error in ((-1, ValueError), (1.5, TypeError), ("yes", TypeError)):
        with pytest.raises(error, match="verify="):
            fxkern.apply(program, rs, verify=bad)
    torch.manual_seed(0)
    with pytest.raises(fxkern.VerificationError):
        fxkern.apply(program, rs, verify=np.int64(200))  # a NumPy count
    # verify=0 checks nothing: an op wrong for every value passes
    always = RuleSet()
    fxkern.replace(bias_gelu_res, wrong_bgr, name="always_wrong", rules=always)
    assert count_target(fxkern.apply(program, always, verify=0), wrong_bgr) == 1
    with pytest.raises(fxkern.VerificationError):
        fxkern.apply(program, always, verify=1)
    if kind == "graph_module":
        with pytest.raises(TypeError, match="verify=3 .* inplace=True"):
            fxkern.apply(program, rs, verify=3, inplace=True)


def test_verify_draws_keyword_inputs_afresh_each_sample(wrong_past_two):
    """A program exported with keyword inputs gets them redrawn in every sample, as its positional
    ones: a difference that shows only for some values of a keyword input is found."""

    class KeywordX(torch.nn.Module):
        def forward(self, b, r, *, x):
            return bias_gelu_res(x, b, r)

    ep = torch.export.export(KeywordX(), (torch.randn(8), torch.randn(4, 8)), {"x": torch.zeros(4, 8)})
    rs = RuleSet()
    fxkern.replace(bias_gelu_res, wrong_past_two, name="sometimes_wrong", rules=rs)
    torch.manual_seed(0)
    with pytest.raises(fxkern.VerificationError, match="random sample"):
        fxkern.apply(ep, rs, verify=200)  # x kept at its example's zeros would never pass 2


class TwoBlocks(torch.nn.Module):
    def forward(self, x, b, r, w):
        y = F.gelu(x + b, approximate="tanh") + r
        return rms(y, w, 1e-6), y.sum()


def _minus_residual(x, b, r):
    return F.gelu(x + b, approximate="tanh") - r  # not what bias_gelu_res computes


@pytest.fixture(scope="module")
def wrong_bgr():
    return fxkern.cuda_kernel_op("fxkern_test::wrong_bgr2", spec_like(bias_gelu_res), reference=_minus_residual)


@pytest.mark.parametrize("kind", ["program", "graph_module"])
def test_verify_names_the_rule_that_changed_an_output(rmsr, wrong_bgr, kind):
    """Of two rules, the one whose op is wrong is named with where it matched; the right one is not."""
    op = wrong_bgr
    rs = RuleSet()
    fxkern.replace(bias_gelu_res, op, name="wrong_bgr", rules=rs)
    fxkern.replace(rms, rmsr[1].op, name="right_rms", rules=rs)
    ep = export(TwoBlocks(), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8), torch.randn(8))
    program = ep if kind == "program" else ep.module()
    with pytest.raises(fxkern.VerificationError) as info:
        fxkern.apply(program, rs, verify=True)
    message = str(info.value)
    assert "rule wrong_bgr (fxkern_test.wrong_bgr2.default), its matches at " in message
    assert "test_rewrite.py:" in message and "right_rms" not in message
    # the right rule alone passes: the check does not blame whatever else was replaced
    assert count_target(fxkern.apply(program, rs["right_rms"], verify=True), rmsr[1].op) == 1


class MLPTail(torch.nn.Module):
    def forward(self, x, b, r):
        return F.gelu(x + b, approximate="tanh") + r  # the line the report points at


def test_report_table_names_rules_and_locations(bgr):
    rs, _ = bgr
    ep = export(MLPTail(), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    text = str(report)
    assert "rule bias_gelu_res: 1 replaced of 2 candidate sites" in text
    line = MLPTail.forward.__code__.co_firstlineno + 1
    assert report.matches[0].location.endswith(f"test_rewrite.py:{line}")
    assert report.matches[0].nodes == ["add", "gelu", "add_1"]


def test_metadata_is_kept(bgr):
    rs, rule = bgr
    ep = export(MLPTail(), torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    new = fxkern.apply(ep, rs)
    call = next(n for n in new.graph.nodes if n.target == rule.op.default)
    assert "test_rewrite.py" in call.meta["stack_trace"]
    assert call.meta["val"].shape == (4, 8)
    assert "nn_module_stack" in call.meta


def test_save_and_load_in_a_fresh_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch, torch.nn.functional as F
        sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'examples')!r}]
        import fxkern
        from helpers import spec_like, Fn
        def saved_bgr(x, b, r):
            return F.gelu(x + b, approximate="tanh") + r
        rule = fxkern.replace(saved_bgr, spec_like(saved_bgr), name="saved::bgr")
        if sys.argv[1] == "save":
            ep = torch.export.export(Fn(saved_bgr), (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)))
            torch.export.save(fxkern.apply(ep), {str(tmp_path / 'p.pt2')!r})
        else:
            ep = torch.export.load({str(tmp_path / 'p.pt2')!r})
            assert any(n.target == torch.ops.saved.bgr.default for n in ep.graph.nodes)
            x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
            torch.testing.assert_close(ep.module()(x, b, r), saved_bgr(x, b, r))
            print("loaded ok")
    """)
    path = tmp_path / "roundtrip.py"
    path.write_text(script)
    subprocess.run([sys.executable, str(path), "save"], check=True, capture_output=True)
    out = subprocess.run([sys.executable, str(path), "load"], check=True, capture_output=True, text=True)
    assert "loaded ok" in out.stdout


def test_cycle_through_an_output_is_refused():
    """No intermediate escapes (the first value is an output), yet contracting the match
    would make it depend on itself through relu."""

    def scaled_pair(x, y):
        a = x * 2
        return a, a * y

    rs = RuleSet()
    fxkern.replace(scaled_pair, spec_like(scaled_pair, n_out=2), rules=rs)

    def fn(x):
        a = x * 2
        c = torch.relu(a)
        return a * c, a

    ep = export(Fn(fn), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches
    (nm,) = report.near_misses
    assert "form a cycle through 'relu'" in nm.reason


def test_rules_apply_to_the_aten_graphs_a_compile_backend_receives(bgr):
    """The forward graph aot_autograd hands a backend: same patterns, no re-authoring."""
    from torch._dynamo.backends.common import aot_autograd

    rs, rule = bgr
    seen = []

    def capture(gm, example_inputs):
        seen.append(fxkern.apply(gm, rs))
        return seen[-1].forward

    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    with torch.no_grad():
        compiled = torch.compile(MLPTail(), backend=aot_autograd(fw_compiler=capture, decompositions={}), fullgraph=True)
        out = compiled(x, b, r)
    torch._dynamo.reset()
    assert count_target(seen[0], rule.op) == 1
    torch.testing.assert_close(out, bias_gelu_res(x, b, r))


# ---- regressions found in review: each a silent change of results or a crash before the fix ----


def test_in_place_update_between_matched_nodes_is_refused():
    def double_relu(c):
        return torch.relu(c * 2)

    rs = RuleSet()
    rule = fxkern.replace(double_relu, spec_like(double_relu), rules=rs)

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cnt", -torch.ones(4, 8))

        def forward(self, x):
            h = self.cnt * 2
            self.cnt.add_(1)  # the op call would read cnt after this update
            return torch.relu(h) + x

    ep = export(Counter(), torch.zeros(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches and "in-place op" in report.near_misses[0].reason
    assert count_target(fxkern.apply(ep, rs), rule.op) == 0


def test_parameter_bound_inside_the_match_is_refused():
    def relu_times(x, y):
        return torch.relu(x) * y

    rs = RuleSet()
    fxkern.replace(relu_times, spec_like(relu_times), rules=rs)

    def fn(x):
        r = torch.relu(x)
        return r * r  # y would bind to relu, which the match computes

    ep = export(Fn(fn), torch.randn(4, 8))
    report = fxkern.explain(ep, rs)
    assert not report.matches and "a value the match itself computes" in report.near_misses[0].reason
    run_both(ep, fxkern.apply(ep, rs), torch.randn(4, 8))


def test_int_and_float_literals_differ():
    def plus_eight(x):
        return x + torch.arange(8)  # an int64 arange

    rs = RuleSet()
    rule = fxkern.replace(plus_eight, spec_like(lambda x: x), name="plus_eight", rules=rs)
    ep = export(Fn(lambda x: x + torch.arange(8.0)), torch.randn(4, 8))
    assert count_target(fxkern.apply(ep, rs), rule.op) == 0


def test_two_scalar_parameters_are_captured_separately():
    def clamp2(x, lo: float, hi: float):
        return torch.clamp(x, lo, hi) * 2

    rs = RuleSet()
    rule = fxkern.replace(clamp2, spec_like(clamp2), rules=rs)
    ep = export(Fn(lambda x: torch.clamp(x, -0.5, 0.25) * 2), torch.randn(4, 8))
    new = fxkern.apply(ep, rs, verify=True)
    call = next(n for n in new.graph.nodes if n.target == rule.op.default)
    assert call.args[1:] == (-0.5, 0.25)


def test_patterns_with_multi_output_ops_and_getitem():
    def ln2(x, w, b):
        return F.layer_norm(x, (8,), w, b) * 2  # native_layer_norm + getitem in core ATen

    rs = RuleSet()
    rule = fxkern.replace(ln2, spec_like(ln2), rules=rs, example_inputs=[torch.randn(4, 8), torch.randn(8), torch.randn(8)])
    ep = export(Fn(ln2), torch.randn(4, 8), torch.randn(8), torch.randn(8))
    assert count_target(fxkern.apply(ep, rs, verify=True), rule.op) == 1
    assert count_target(fxkern.apply(ep.run_decompositions(), rs, verify=True), rule.op) == 1


def test_verify_on_a_symbolically_traced_graph(bgr):
    from torch.fx.experimental.proxy_tensor import make_fx

    rs, rule = bgr
    gm = make_fx(bias_gelu_res, tracing_mode="symbolic")(torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    assert count_target(fxkern.apply(gm, rs, verify=True), rule.op) == 1


def test_apply_keeps_a_placeholder_named_like_a_builtin():
    """torch.export names nn.Softmax's input 'input'; the rewritten program keeps that name."""
    from helpers import spec_like

    def softmax(x):
        return torch.softmax(x, -1)

    rules = fxkern.RuleSet("builtin-name")
    fxkern.replace(softmax, spec_like(softmax), name="fxkern_test_builtin::softmax", rules=rules)
    ep = torch.export.export(torch.nn.Softmax(-1), (torch.randn(4, 8),))
    assert ep.graph_signature.input_specs[0].arg.name == "input"
    new = fxkern.apply(ep, rules)
    x = torch.randn(4, 8)
    torch.testing.assert_close(new.module()(x), torch.softmax(x, -1))


def test_the_pass_leaves_the_garbage_collector_as_it_found_it(bgr):
    """apply and explain pause Python's collector while they run (it would rescan the live graph
    for nothing); afterwards it is on again, also after an error, and stays off if it was off."""
    import gc

    rs, rule = bgr
    x, b, r = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    ep = export(Fn(bias_gelu_res), x, b, r)
    assert gc.isenabled()
    new = fxkern.apply(ep, rs)
    assert count_target(new, rule.op) == 1 and gc.isenabled()
    fxkern.explain(ep, rs)
    assert gc.isenabled()

    seen = []

    def failing_filter(match):
        seen.append(gc.isenabled())
        raise RuntimeError("filter bug")

    bad = RuleSet("bad")
    fxkern.replace(bias_gelu_res, rule.op, rules=bad, filter=failing_filter)
    with pytest.raises(RuntimeError, match="filter bug"):
        fxkern.apply(ep, bad)
    assert seen == [False] and gc.isenabled()

    gc.disable()
    try:
        fxkern.apply(ep, rs)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_report_without_rules_says_where_rules_come_from():
    """It said only "no rules" (found by a usability test)."""
    ep = torch.export.export(Fn(lambda x: x * 2), (torch.randn(4),))
    text = str(fxkern.explain(ep, RuleSet("empty")))
    assert "fxkern.library.rules()" in text and "fxkern.region" in text


class NoGradThen(torch.nn.Module):
    def __init__(self, after):
        super().__init__()
        self.after, self.w = after, torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x, r):
        y = x * 3 + r
        with torch.no_grad():
            z = torch.relu(y)
        return self.after(z, self.w)


@pytest.mark.parametrize("after", [lambda z, w: (z @ w).view(-1), lambda z, w: z.t() + 1],
                         ids=["a matmul, then a view", "a transpose"])
def test_what_follows_a_no_grad_block_refuses_only_views_that_may_fail(layouts, after):
    """After the block, a transpose takes any layout, and a matmul lays its result out afresh: every
    later aliasing op refused the match (found by a review)."""
    _, _, cols = layouts
    args = (torch.randn(6, 6), torch.randn(6, 6))
    ep = torch.export.export(NoGradThen(after), args)
    assert len(fxkern.explain(ep, cols).matches) == 1
    torch.testing.assert_close(fxkern.apply(ep, cols).module()(*args), ep.module()(*args))


def mul_add(x, y, r):
    return x * y + r


def test_both_operand_orders_meet_the_same_later_view():
    """The first operand order of the mul is refused for a later view; the second reached the same
    nodes laid out the same, and a remembered "no refusal" for a node ended its walk before the view:
    accepted, and the program crashed (found by a review)."""
    rs = RuleSet("mul_add")
    fxkern.replace(mul_add, spec_like(mul_add), rules=rs)
    args = (torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6))
    model = Fn(lambda a, b, c: (a.t() * b.t() + c.t()).t().view(24) + 1)
    ep = torch.export.export(model, args)
    assert not fxkern.explain(ep, rs).matches
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(*args), model(*args))


def test_a_changed_layout_at_symbolic_sizes_is_checked(layouts):
    """Symbolic strides are no dictionary key: the check crashed (found by a review)."""
    rs, rows, _ = layouts
    d0, d1 = torch.export.Dim("a", min=2, max=64), torch.export.Dim("b", min=2, max=64)
    model = Fn(lambda x, r: (x.t() * 3 + r.t()) * 2)
    ep = torch.export.export(model, (torch.randn(4, 6), torch.randn(4, 6)),
                             dynamic_shapes=(({0: d0, 1: d1}, {0: d0, 1: d1}),))
    new = fxkern.apply(ep, rs)
    assert count_target(new, rows.op) == 1
    args = (torch.randn(5, 7), torch.randn(5, 7))
    torch.testing.assert_close(new.module()(*args), model(*args))


class ComplexInNoGrad(torch.nn.Module):
    def forward(self, x, r):
        y = x.t() * 3 + r.t()
        with torch.no_grad():
            z = torch.view_as_real(torch.view_as_complex(y.t()) * 2)
        return z + 1


def test_a_view_of_any_kind_in_a_no_grad_block_refuses_a_changed_layout(layouts):
    """view_as_complex needs a last stride of 1, which the op's layout does not give: accepted, the
    program crashed (found by a review)."""
    rs, _, _ = layouts
    args = (torch.randn(6, 2), torch.randn(6, 2))
    ep = torch.export.export(ComplexInNoGrad(), args)
    report = fxkern.explain(ep, rs)
    assert not report.matches and "in its subgraph, which depends on the layout" in report.near_misses[0].reason
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(*args), ep.module()(*args))


class ViewAfterNoGrad(torch.nn.Module):
    def forward(self, x, r):
        with torch.no_grad():
            y = x.t() * 3 + r.t()
        return y.t().view(-1) + 1


def test_a_block_result_leaving_in_another_layout_is_refused(layouts):
    """The match inside the no_grad block wrote rows where eager kept the transposed layout, and the
    view after the block, traced on eager's, failed when the program ran (the graph around a
    block was never told of its new layout). A block's outputs keep their strides."""
    rs, _, _ = layouts
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(ViewAfterNoGrad(), args)
    report = fxkern.explain(ep, rs)
    assert not report.matches and "a view after the block takes the old strides" in report.near_misses[0].reason
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(*args), ep.module()(*args))


class SumAfterAutocast(torch.nn.Module):
    def forward(self, x, r):
        with torch.autocast("cpu", enabled=False):
            y = x.t() * 3 + r.t()
        return y.sum(0)


class SizeOneViewAfterNoGrad(torch.nn.Module):
    def forward(self, x, r):
        with torch.no_grad():
            y = x * 3 + r
        return y.view(-1) + 1


@pytest.mark.parametrize("model, shape", [(SumAfterAutocast(), (4, 6)), (SizeOneViewAfterNoGrad(), (1, 6))],
                         ids=["summed after the block", "viewed, differing at a dim of size 1"])
def test_a_block_result_nothing_after_depends_on_may_change_layout(layouts, model, shape):
    """Only a view or as_strided after a block relies on its outputs' strides, and a dim of size 1
    never matters to one: every block output was held, and blocks lost their matches (found by a
    review; autocast(enabled=False) is common around norms)."""
    rows, _, cols = layouts
    rs = rows if isinstance(model, SumAfterAutocast) else cols
    args = (torch.randn(*shape), torch.randn(*shape))
    ep = torch.export.export(model, args)
    assert len(fxkern.explain(ep, rs).matches) == 1
    new = fxkern.apply(ep, rs)
    torch.testing.assert_close(new.module()(*args), model(*args))
    torch.testing.assert_close(new.run_decompositions().module()(*args), model(*args))


def test_a_fake_run_is_not_reused_for_an_input_of_another_layout():
    """The op's meta_fn takes contiguous inputs only. Its answer for a contiguous input was reused
    for a transposed one of the same shape: accepted, and run_decompositions() failed on it."""
    def contiguous_only(x, r):
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")
        return torch.empty_like(x)

    rs = RuleSet("contiguous_only")
    op = fxkern.cuda_kernel_op("test_rewrite::t3p_contiguous", spec_like(times3_plus), meta_fn=contiguous_only,
                               reference=times3_plus)
    fxkern.replace(times3_plus, op, name="t3p_contiguous", rules=rs)
    model = Fn(lambda x, z, r: (x * 3 + r) + (z.t() * 3 + r))
    args = (torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4))
    ep = torch.export.export(model, args)
    report = fxkern.explain(ep, rs)
    assert len(report.matches) == 1 and "x must be contiguous" in report.near_misses[0].reason
    new = fxkern.apply(ep, rs)
    torch.testing.assert_close(new.run_decompositions().module()(*args), model(*args))


def scale_up_or_down(x, alpha: float):
    if alpha > 1.0:
        return x * alpha
    return x / alpha


def test_a_pattern_branching_on_a_scalar_is_refused_where_the_branch_differs():
    """Traced with a sentinel under 1, the pattern is a division: it matched a model's x / 2.0, and
    the op, which runs the pattern at alpha = 2.0, multiplied (found by a probe). Traced again at the
    match's values it runs a mul: refused, with the reason. At 0.5 both take the division."""
    rs = RuleSet("branching")
    fxkern.replace(scale_up_or_down, spec_like(scale_up_or_down), rules=rs)
    x = torch.randn(4, 8)
    for divisor, matched in ((2.0, False), (0.5, True)):
        model = Fn(lambda t: t / divisor)
        ep = torch.export.export(model, (x,))
        report = fxkern.explain(ep, rs)
        assert bool(report.matches) == matched, str(report)
        if not matched:
            assert "Python control flow on a scalar parameter" in report.near_misses[0].reason
        torch.testing.assert_close(fxkern.apply(ep, rs).module()(x), model(x))


def scale_wide_rows_up(x, alpha: float):
    if alpha > 1 and x.shape[-1] >= 8:
        return x * alpha
    return x / alpha


@pytest.mark.parametrize("order", ["narrow first", "wide first"])
def test_a_branch_on_a_scalar_and_a_size_is_judged_at_each_size(order):
    """The check was cached per scalar values: the first match's sizes decided for every later one,
    a wrong result in one order and a false refusal in the other (found by a review)."""
    rs = RuleSet("wide_rows")
    fxkern.replace(scale_wide_rows_up, spec_like(scale_wide_rows_up), rules=rs, name=f"scale_wide_rows_up_{order[0]}")
    shapes = [(4, 2), (4, 16)] if order == "narrow first" else [(4, 16), (4, 2)]
    for shape in shapes:
        x, model = torch.randn(*shape), Fn(lambda t: t / 4.0)
        ep = torch.export.export(model, (x,))
        assert len(fxkern.explain(ep, rs).matches) == (shape[-1] < 8)
        torch.testing.assert_close(fxkern.apply(ep, rs).module()(x), model(x))


def times_ratio(x):
    return x * (x.shape[1] // x.shape[0])


def test_a_ratio_of_sizes_counts_as_a_number_from_sizes():
    """Doubling every size keeps 8 // 4: ``x.shape[1] // x.shape[0]`` read as a constant 2, and a
    model doubling a (4, 12) tensor was replaced by one tripling it (found by a review)."""
    rs = RuleSet("ratio")
    fxkern.replace(times_ratio, spec_like(times_ratio), rules=rs)
    model, x = Fn(lambda x: x * 2), torch.randn(4, 12)
    ep = torch.export.export(model, (x,))
    assert not fxkern.explain(ep, rs).matches
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(x), model(x))
    written = torch.export.export(Fn(times_ratio), (x,))
    assert len(fxkern.explain(written, rs).matches) == 1


class TransposedChain(torch.nn.Module):
    def forward(self, x, r):
        h, rt = x.t(), r.t()
        for _ in range(300):
            h = torch.sin(h * 3 + rt)
        return h


def test_the_layout_check_costs_little_on_a_model_of_another_layout(layouts):
    """Each of 300 matches in a transposed model changes every later node's layout the same way:
    checked once, not once a match (a review timed 21 s for this; DESIGN.md asks tens of thousands
    of nodes in well under a second)."""
    import time

    rs, rows, _ = layouts
    args = (torch.randn(4, 6), torch.randn(4, 6))
    ep = torch.export.export(TransposedChain(), args)
    fxkern.explain(ep, rs)  # the rule's traces, made once
    start = time.perf_counter()
    new = fxkern.apply(ep, rs)
    assert time.perf_counter() - start < 5.0
    assert count_target(new, rows.op) == 300
    torch.testing.assert_close(new.module()(*args), ep.module()(*args))


@torch.library.custom_op("fxkern_test::rows_of", mutates_args=())
def rows_of(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.view(-1, k) * 2


rows_of.register_fake(lambda x, k: x.new_empty((x.numel() // k, k)))


def view_rows(x, k: int):
    return x.view(-1, k) * 2


def test_a_scalar_inside_a_list_argument_is_a_near_miss_not_a_crash():
    """A view's size inside its list argument is not captured, and explain crashed with KeyError: 'k'
    (found by a review)."""
    rs = RuleSet("view_rows")
    fxkern.replace(view_rows, torch.ops.fxkern_test.rows_of, rules=rs, example_inputs=[torch.randn(4, 8), 8])
    x = torch.randn(4, 8)
    ep = torch.export.export(Fn(lambda t: t.view(-1, 8) * 2), (x,))
    report = fxkern.explain(ep, rs)
    assert not report.matches and "binds no value for the pattern's parameter(s) ['k']" in report.near_misses[0].reason
    torch.testing.assert_close(fxkern.apply(ep, rs).module()(x), x.view(-1, 8) * 2)


class Cache(torch.nn.Module):
    """A decoder step: writes the token into a cache buffer, bumps the position, reads both."""

    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("cache", torch.zeros(4, 8))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def forward(self, x, r):
        self.cache.index_copy_(0, self.pos.view(1), x)
        self.pos.add_(1)
        return bias_gelu_res(self.cache, self.b, r) * self.pos


def test_verify_leaves_the_models_state_alone_and_runs_both_from_it(bgr):
    """verify=True ran the old program, then the new one, on the model's own buffers: the cache and
    position moved (export shares them with the model), and the second run started from the state
    the first left, so a correct rewrite was reported as changing the output (found by a probe)."""
    rs, rule = bgr
    model = Cache().eval()
    x, r = torch.randn(1, 8), torch.randn(4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = fxkern.apply(export(model, x, r), rs, verify=True)
    assert count_target(new, rule.op) == 1
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
    assert model.pos.item() == 0


def _times_k(x, k: int):
    return torch.relu(x * k)


def test_a_captured_scalar_the_kernel_cannot_take_is_a_near_miss():
    """A 2**40 captured for a 32-bit int was replaced, and the rewritten program failed when run
    (found by a probe): the fake impl now checks scalars as the launch does."""
    rs = RuleSet()
    rule = fxkern.replace(_times_k, spec_like(_times_k), name="times_k", rules=rs)
    ep = export(Fn(lambda x: torch.relu(x * 2**40)), torch.randn(4, 8))
    assert fxkern.apply(ep, rs) is ep
    (miss,) = fxkern.explain(ep, rs).near_misses
    assert "scalar 'k' = 1099511627776 does not fit the kernel's 32-bit int" in miss.reason
    assert count_target(fxkern.apply(export(Fn(lambda x: torch.relu(x * 3)), torch.randn(4, 8)), rs), rule.op) == 1


# ---- in-place calls as torch.export's default IR keeps them ----


def test_an_in_place_add_on_a_value_only_it_reads_matches_as_the_add(bgr):
    """``h += b`` stays ``aten.add_`` in the export IR, where patterns hold ``aten.add``: when the
    call writes a fresh value that nothing else reads, the two cannot be told apart, and the match
    takes it (T5 4.x's ``scores += position_bias``, residual code's ``out += identity``)."""
    rs, rule = bgr

    def fn(x, b, r):
        h = x * 1.5  # fresh, read only by the add_
        h += b
        y = F.gelu(h, approximate="tanh")
        y += r
        return y

    args = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
    ep = export(Fn(fn), *args)
    assert sum(n.target == torch.ops.aten.add_.Tensor for n in ep.graph.nodes) == 2
    twins = index_graph(ep.graph)[1]
    assert [twins.get(n) for n in ep.graph.nodes if n.target == torch.ops.aten.add_.Tensor] == [torch.ops.aten.add.Tensor] * 2
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, rule.op) == 1
    assert not any(n.target == torch.ops.aten.add_.Tensor for n in new.graph.nodes)
    run_both(ep, new, *args)


def test_in_place_calls_that_can_be_told_apart_from_the_add_are_not_matched(bgr):
    """An in-place call is left as it is (and any match around it refused) when its write can be seen:
    on a model input, on a value read elsewhere, through an alias (``type_as`` to the same dtype returns
    its input), or where ``add_`` keeps a dtype that ``add`` would promote."""
    rs, rule = bgr

    def on_input(x, b, r):
        x += b
        return F.gelu(x, approximate="tanh") + r

    def read_elsewhere(x, b, r):
        h = x * 1.5
        kept = h * 2.0
        h += b
        return F.gelu(h, approximate="tanh") + r, kept

    def through_an_alias(x, b, r):
        h = x * 1.5
        y = h.type_as(x)  # h itself
        y += b
        return F.gelu(y, approximate="tanh") + r, h

    def keeps_its_dtype(x, b, r):
        h = (x * 1.5).to(torch.bfloat16)
        h += b  # float32 b: the in-place sum stays bfloat16
        return F.gelu(h, approximate="tanh") + r

    for fn in (on_input, read_elsewhere, through_an_alias, keeps_its_dtype):
        args = (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8))
        ep = export(Fn(fn), *[a.clone() for a in args])
        # each guard on its own (the match's other checks would refuse some of these too)
        written = [n for n in ep.graph.nodes if n.target == torch.ops.aten.add_.Tensor]
        assert len(written) == 1 and written[0] not in index_graph(ep.graph)[1], fn.__name__
        new = fxkern.apply(ep, rs)
        assert count_target(new, rule.op) == 0, fn.__name__
        want, got = ep.module()(*[a.clone() for a in args]), new.module()(*[a.clone() for a in args])
        for u, v in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert torch.equal(u, v), fn.__name__


def test_an_in_place_comparison_is_not_its_bool_twin():
    """``t.lt_(b)`` on a float ``t`` leaves float 0. and 1. where ``t < b`` gives bool: a pattern adding
    two comparisons (bool + bool is a logical or) took two ``lt_`` calls, and 1. replaced 2. (found by
    a review). The twin must give the written value's dtype; ``pow_.Scalar`` (tensor ** scalar) has
    the argument names of ``pow.Scalar`` (scalar ** tensor) but not their types."""
    from fxkern.matcher import _twin

    def either(a, b, c, d):
        return ((a < b) + (c < d)) * d

    rs = RuleSet("either")
    rule = fxkern.replace(either, spec_like(either), rules=rs)

    def fn(a, b, c, d):
        t = a * 1.0
        t.lt_(b)
        u = c * 1.0
        u.lt_(d)
        return (t + u) * d

    args = (torch.zeros(8), torch.ones(8), torch.zeros(8), torch.ones(8))
    ep = export(Fn(fn), *args)
    new = fxkern.apply(ep, rs)
    assert count_target(new, rule.op) == 0
    assert torch.equal(new.module()(*args), torch.full((8,), 2.0))
    assert _twin(torch.ops.aten.lt_.Tensor) is torch.ops.aten.lt.Tensor  # the names and types agree: the dtype decides
    assert _twin(torch.ops.aten.pow_.Scalar) is None and _twin(torch.ops.aten.add_.Tensor) is torch.ops.aten.add.Tensor


def test_a_long_chain_of_in_place_adds_is_walked_once(bgr):
    """``acc += xs[i]`` in a loop is a chain of in-place calls, each writing the one before: walked
    link by link for each call, 1200 of them exceeded Python's recursion limit and took quadratic time
    before that (found by a review). The chain is walked once; its last add and the GELU after it match."""
    import time

    rs, rule = bgr
    n = 1500

    class Accumulate(torch.nn.Module):
        def forward(self, xs, b, r):
            acc = torch.zeros(4, 8)
            for i in range(n):
                acc += xs[i]
            return F.gelu(acc + b, approximate="tanh") + r

    args = (torch.randn(n, 4, 8), torch.randn(8), torch.randn(4, 8))
    ep = torch.export.export(Accumulate(), args)
    start = time.perf_counter()
    new = fxkern.apply(ep, rs)
    assert time.perf_counter() - start < 10.0
    assert count_target(new, rule.op) == 1
    torch.testing.assert_close(new.module()(*args), Accumulate()(*args))
