"""Views moved above the elementwise op they view (fxkern.views), so that a residual add and the norm
after it match with a reshape between them (transformers' OPT, in tests/test_hf_models.py), and left
where moving them would change a value, a layout, or what a model's other readers see."""

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fxkern
import fxkern.library as lib
from fxkern import views
from fxkern.rewrite import rewrite_graph
from helpers import Fn, export, spec_like

D = 16


class OptBlock(torch.nn.Module):
    """OPT's decoder layer around its two adds, as transformers writes it: the attention block's sum
    reshaped to rows before ``final_layer_norm`` (and kept as the next residual), the MLP's sum viewed
    back to the layer's shape before the next layer's ``self_attn_layer_norm``."""

    def __init__(self):
        super().__init__()
        self.attn, self.fc = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.final_layer_norm, self.next_norm = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)

    def forward(self, x, residual):
        h = residual + self.attn(x)
        shape = h.shape
        h = h.reshape(-1, h.size(-1))
        residual = h
        h = self.fc(self.final_layer_norm(h))
        h = (residual + h).view(shape)
        return self.next_norm(h), h


def names_before(program):
    return {n.name for n in program.graph.nodes}


def add_layer_norm_calls(program):
    return sum(1 for n in program.graph.nodes if "add_layer_norm" in str(n.target))


def _inputs(batch=2):
    return torch.randn(batch, 5, D), torch.randn(batch, 5, D)


def test_an_add_then_a_reshape_then_a_layer_norm_is_one_op():
    ep = export(OptBlock().eval(), *_inputs())
    before = str(ep.graph)
    new = fxkern.apply(ep, lib.rules(), verify=True)
    assert add_layer_norm_calls(new) == 2
    assert str(ep.graph) == before, "the views were moved in the program passed in, not a copy"
    # the sum the block returns was a view, now a result of the op: the program's output names follow
    names = {n.name for n in new.graph.nodes}
    assert all(o in names for o in new.graph_signature.user_outputs)
    x, r = _inputs()
    for want, got in zip(ep.module()(x, r), new.module()(x, r)):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want)
    report = fxkern.explain(ep, lib.rules())
    assert len(report["add_layer_norm"].matches) == 2
    assert str(ep.graph) == before
    # the report names a moved add for the add and the view it replaced, both in the program's graph
    views_in = {n.name for n in ep.graph.nodes if n.target in views.VIEWS}
    adds_in = {n.name for n in ep.graph.nodes if n.target == torch.ops.aten.add.Tensor}
    named = [n for m in report["add_layer_norm"].matches for n in m.nodes if n not in names_before(ep)]
    assert named and all(any(n == f"{a}_{v}" for a in adds_in for v in views_in) for n in named), named


def test_a_view_to_symbolic_sizes_moves_too():
    """OPT views back to ``hidden_states.shape``: with a dynamic batch, sizes computed in the graph."""
    batch = torch.export.Dim.DYNAMIC
    ep = export(OptBlock().eval(), *_inputs(), dynamic_shapes=({0: batch}, {0: batch}))
    assert any(isinstance(a, torch.fx.Node) for n in ep.graph.nodes if n.target == torch.ops.aten.view.default
               for a in n.args[1]), "the view's sizes are literal here; this test wants them computed"
    new = fxkern.apply(ep, lib.rules(), verify=True)
    assert add_layer_norm_calls(new) == 2
    x, r = _inputs(batch=7)
    for want, got in zip(ep.module()(x, r), new.module()(x, r)):
        torch.testing.assert_close(got, want)


def _moved_in(fn, *args):
    return views.movable(export(Fn(fn), *args).graph)


def _twice_read(h):
    return _norm(h.view(-1, D)), h * 2


def _norm(h):
    return F.layer_norm(h, (h.shape[-1],))


@pytest.mark.parametrize("case, fn, args", [
    # a view that splits the last axis (heads): row ops reduce that axis, so it stays
    ("splits the last axis", lambda a, b: _norm((a + b).view(2, 5, 4, 4)), (torch.randn(2, 5, D), torch.randn(2, 5, D))),
    # the sum read elsewhere too: moving the view would run the add twice
    ("the sum has another reader", lambda a, b: _twice_read(a + b), (torch.randn(2, 5, D), torch.randn(2, 5, D))),
    # a broadcast operand: its view is not the sum's
    ("a broadcast operand", lambda a, b: _norm((a + b).view(-1, D)), (torch.randn(2, 5, D), torch.randn(D))),
    # an operand that cannot be viewed so without a copy
    ("a transposed operand", lambda a, b: _norm((a.transpose(0, 1) + b).reshape(-1, D)),
     (torch.randn(5, 2, D), torch.randn(2, 5, D))),
])
def test_views_that_stay(case, fn, args):
    del case
    assert _moved_in(fn, *args) == []


def test_the_moved_views_compute_the_same_values_and_layouts():
    """Two chained adds, a scaled residual (a mul), a view of an operand that is itself a view."""

    def fn(a, b, c):
        h = (a + b).reshape(-1, D)
        g = (h * c.reshape(-1, D)).view(2, 5, D)
        return _norm(g), g

    args = (torch.randn(2, 5, D), torch.randn(2, 5, D), torch.randn(2, 5, D))
    gm = export(Fn(fn), *args).module()  # a GraphModule of its own: its outputs are positions, not names
    moved = views.move_views(gm.graph)
    assert len(moved) == 2
    gm.recompile()
    targets = Counter(str(n.target) for n in gm.graph.nodes)
    # a, b and c each reshaped, the sum and c's reshape each viewed: five views for the two there were
    assert targets["aten.view.default"] + targets["aten.reshape.default"] == 5
    assert targets["aten.add.Tensor"] == 1 and targets["aten.mul.Tensor"] == 1
    want = fn(*args)
    got = gm(*args)
    for w, g in zip(want, got):
        assert g.stride() == w.stride()
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def gelu_new_then_rows(x):
    """GPT-2's MLP between its two Conv1Ds: ``gelu_new`` written out (its last op a mul), then the
    next Conv1D's ``x.view(-1, x.size(-1))``."""
    g = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    return torch.tanh(g.view(-1, g.size(-1)))


def test_a_view_after_a_match_stays_outside_it():
    """The view reads the GELU's last mul alone, and moving it above that mul would cut the GELU's
    pattern in two: views move only outside the matches the graph has as written."""
    x = torch.randn(2, 5, D)
    ep = export(Fn(gelu_new_then_rows), x)
    assert views.movable(ep.graph), "the view is movable when matches are not counted; this test wants it so"
    new = fxkern.apply(ep, lib.rules(), verify=True)
    assert sum(1 for n in new.graph.nodes if "gelu_new" in str(n.target)) == 1
    torch.testing.assert_close(new.module()(x), gelu_new_then_rows(x))


def test_a_program_nothing_matches_is_returned_as_it_was():
    ep = export(Fn(lambda a, b: torch.tanh((a + b).view(-1, D))), torch.randn(2, 5, D), torch.randn(2, 5, D))
    assert views.movable(ep.graph)
    assert fxkern.apply(ep, lib.rules()) is ep


def test_a_compiler_pass_moves_them_in_its_own_graph():
    """``rewrite_graph`` (torch.compile's and Torch-TensorRT's pass) works on the graph it is given."""
    ep = export(OptBlock().eval(), *_inputs())
    gm = ep.module()
    report = rewrite_graph(gm.graph, lib.rules(), ("export",))
    gm.recompile()
    assert len(report["add_layer_norm"].matches) == 2
    x, r = _inputs()
    for want, got in zip(ep.module()(x, r), gm(x, r)):
        torch.testing.assert_close(got, want)


def rows_of_sum(x, r, w):
    """A user's pattern that views a sum itself (rows, then back): its view moves as the model's does."""
    return torch.tanh((x + r).reshape(-1, x.shape[-1])).view(x.shape) * w


class RowsOfSum(torch.nn.Module):
    def forward(self, x, r, w):
        return torch.tanh((x + r).reshape(-1, D)).view(2, 5, D) * w


@pytest.fixture(scope="module")
def rows_rule():
    rs = fxkern.RuleSet("rows")
    # traced at a model's shapes: at the default (4, 8) examples the reshape keeps the shape, and is noise
    examples = (torch.randn(2, 5, D), torch.randn(2, 5, D), torch.randn(D))
    return rs, fxkern.replace(rows_of_sum, spec_like(rows_of_sum), rules=rs, example_inputs=examples)


@pytest.mark.parametrize("where", ["export", "fxkern.backend"])
def test_a_pattern_that_views_a_sum_still_matches(where, rows_rule):
    rs, rule = rows_rule
    x, r, w = torch.randn(2, 5, D), torch.randn(2, 5, D), torch.randn(D)
    if where == "export":
        ep = export(RowsOfSum(), x, r, w)
        new = fxkern.apply(ep, rs, verify=True)
        assert sum(1 for n in new.graph.nodes if n.target == rule.op.default) == 1
        torch.testing.assert_close(new.module()(x, r, w), RowsOfSum()(x, r, w))
        return
    reports = []
    compiled = torch.compile(RowsOfSum(), backend=fxkern.backend(rs, inner="aot_eager", report=reports.append))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, r, w), RowsOfSum()(x, r, w))
    torch._dynamo.reset()
    assert sum(len(rep["rows_of_sum"].matches) for rep in reports) == 1


def add_tanh(x, r):
    h = x + r
    return torch.tanh(h), h


class ViewedSum(torch.nn.Module):
    def forward(self, a, b):
        h = (a + b).view(-1, D)
        return torch.tanh(h), h


@pytest.fixture(scope="module")
def add_tanh_rule():
    rs = fxkern.RuleSet("add_tanh")
    return rs, fxkern.replace(add_tanh, spec_like(add_tanh, n_out=2), rules=rs)


@pytest.mark.parametrize("where", ["export", "fxkern.backend"])
def test_a_moved_view_lets_a_rule_match_under_export_and_torch_compile(where, add_tanh_rule):
    rs, rule = add_tanh_rule
    a, b = torch.randn(2, 5, D), torch.randn(2, 5, D)
    want = ViewedSum()(a, b)
    if where == "export":
        new = fxkern.apply(export(ViewedSum(), a, b), rs, verify=True)
        assert sum(1 for n in new.graph.nodes if n.target == rule.op.default) == 1
        got = new.module()(a, b)
    else:
        reports = []
        compiled = torch.compile(ViewedSum(), backend=fxkern.backend(rs, inner="aot_eager", report=reports.append))
        with torch.no_grad():
            got = compiled(a, b)
        torch._dynamo.reset()
        assert sum(len(rep["add_tanh"].matches) for rep in reports) == 1
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.stride() == w.stride()
        torch.testing.assert_close(g, w)


class WritesBetween(torch.nn.Module):
    """An operand written in place, inside a ``torch.no_grad()`` block, between the add and the view:
    the sum was taken before the write, and a moved add would read the written values."""

    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)

    def forward(self, a, b):
        h = a + b
        with torch.no_grad():
            a.mul_(0)
        return self.ln(h.view(-1, D))


def test_a_write_inside_a_block_between_the_add_and_the_view_keeps_it_where_it_is():
    a, b = torch.randn(2, 5, D), torch.randn(2, 5, D)
    ep = export(WritesBetween().eval(), a.clone(), b)
    assert views.movable(ep.graph) == []
    new = fxkern.apply(ep, lib.rules(), verify=True)
    torch.testing.assert_close(new.module()(a.clone(), b), ep.module()(a.clone(), b))


def test_a_write_inside_a_block_inside_a_match_refuses_it():
    """The same write where nothing is viewed: the add + LayerNorm would move the add past it."""

    class M(WritesBetween):
        def forward(self, a, b):
            h = a + b
            with torch.no_grad():
                a.mul_(0)
            return self.ln(h)

    a, b = torch.randn(2, 5, D), torch.randn(2, 5, D)
    ep = export(M().eval(), a.clone(), b)
    new = fxkern.apply(ep, lib.rules())
    assert add_layer_norm_calls(new) == 0
    torch.testing.assert_close(new.module()(a.clone(), b), ep.module()(a.clone(), b))


def test_a_view_whose_moved_sum_would_be_laid_out_otherwise_stays():
    """``a + b`` with b read transposed is laid out as a; viewed to (2, 1, 5, D) its strides are not
    those of the views' sum, which later code may rely on."""
    fn = lambda a, bt: _norm((a + bt.transpose(0, 1)).view(2, 1, 5, D))  # noqa: E731
    assert _moved_in(fn, torch.randn(2, 5, D), torch.randn(5, 2, D)) == []


@pytest.mark.parametrize("viewed", [True, False])
def test_a_preserved_module_calls_values_stay_and_it_unflattens(viewed):
    """The call's result is the add (or its view), the norm is outside the call: neither a moved view
    nor an add + LayerNorm may replace what ``unflatten`` finds by name (apply raised on both)."""

    class Block(torch.nn.Module):
        def forward(self, a, b):
            return (a + b).view(-1, D) if viewed else a + b

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blk, self.ln = Block(), torch.nn.LayerNorm(D)

        def forward(self, a, b):
            return self.ln(self.blk(a, b))

    a, b = torch.randn(2, 5, D), torch.randn(2, 5, D)
    ep = torch.export.export(Outer().eval(), (a, b), preserve_module_call_signature=("blk",))
    new = fxkern.apply(ep, lib.rules())
    torch.testing.assert_close(torch.export.unflatten(new)(a, b), Outer().eval()(a, b))
    if not viewed:
        misses = fxkern.explain(ep, lib.rules())["add_layer_norm"].near_misses
        assert any("preserved module call" in m.reason for m in misses)


def gelu_ish(x, y):
    t = torch.tanh(x)
    return (t * y) * 0.5 + t


def test_the_first_passes_matches_are_kept():
    """A view the first pass's match reads stays, and a higher-priority rule the moved view would
    let match instead does not take that match's nodes."""
    rs = fxkern.RuleSet("kept")
    first = fxkern.replace(gelu_ish, spec_like(gelu_ish), rules=rs)
    fxkern.replace(add_tanh_only, spec_like(add_tanh_only), rules=rs, priority=-1)

    def model(a, b, y):
        t = torch.tanh((a + b).view(-1, D))
        return (t * y) * 0.5 + t

    args = (torch.randn(2, 5, D), torch.randn(2, 5, D), torch.randn(10, D))
    new = fxkern.apply(export(Fn(model), *args), rs, verify=True)
    assert [str(n.target) for n in new.graph.nodes if "fxkern" in str(n.target)] == [str(first.op.default)]


def add_tanh_only(x, r):
    return torch.tanh(x + r)
