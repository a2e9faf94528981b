"""fxkern.region: a marked block of model code becomes one op call after plain torch.export."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxkern
from fxkern import RuleSet
from helpers import count_target, spec_like

ROOT = Path(__file__).resolve().parents[1]


def gelu_bias_ref(x, b):
    return F.gelu(x + b, approximate="tanh")


GELU_BIAS = fxkern.cuda_kernel_op("fxkern_test::region_gelu_bias", spec_like(gelu_bias_ref), reference=gelu_bias_ref)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.lin(x)
        with fxkern.region(GELU_BIAS):
            y = h + self.b
            y = F.gelu(y, approximate="tanh")
        return y * 2


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def test_region_survives_plain_export_and_is_replaced_once_per_instance():
    model = Stack().eval()
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,))
    new = fxkern.apply(ep, RuleSet("empty"), verify=True)  # regions are replaced whatever the rule set
    assert count_target(new, GELU_BIAS) == 2
    torch.testing.assert_close(new.module()(x), model(x))
    report = fxkern.explain(ep, RuleSet("empty"))
    assert sum(len(r.matches) for name, r in report.rules.items() if name.startswith("region@")) == 2


def test_region_is_a_no_op_in_eager():
    model = Block()
    x = torch.randn(4, 8)
    h = model.lin(x)
    torch.testing.assert_close(model(x), F.gelu(h + model.b, approximate="tanh") * 2)


class WrongArity(torch.nn.Module):
    def forward(self, x, y, z):
        with fxkern.region(GELU_BIAS):
            w = F.gelu(x + y, approximate="tanh") * z
        return w


def test_region_whose_interface_does_not_fit_the_op_is_reported():
    ep = torch.export.export(WrongArity(), (torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)))
    report = fxkern.explain(ep, RuleSet("empty"))
    (nm,) = [m for m in report.near_misses if m.rule.startswith("region@")]
    assert "takes 2 arguments" in nm.reason
    assert count_target(fxkern.apply(ep, RuleSet("empty")), GELU_BIAS) == 0


def test_region_survives_dynamo_and_aot_autograd():
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def capture(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    model = Block().eval()
    x = torch.randn(4, 8)
    model(x)  # the site is recorded when the block first runs outside the compiler (eager or export)
    with torch.no_grad():
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture, decompositions={}), fullgraph=True)
        compiled(x)
    (gm,) = seen
    new = fxkern.apply(gm, RuleSet("empty"))
    assert count_target(new, GELU_BIAS) == 1
    torch._dynamo.reset()


class Looped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        for _ in range(2):
            with fxkern.region(GELU_BIAS):
                x = F.gelu(x + self.b, approximate="tanh")
        return x


def test_a_block_run_twice_in_a_chain_is_one_op_call_a_run():
    """torch.export's default tracing runs the block in Python: each run's nodes are tagged, so each
    run becomes its own op call."""
    model = Looped()
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,))
    new = fxkern.apply(ep, RuleSet("empty"))
    assert count_target(new.graph_module, GELU_BIAS) == 2
    torch.testing.assert_close(new.module()(x), model(x))


def test_a_block_run_twice_in_a_chain_is_refused_not_merged_where_only_stack_traces_tell():
    """Strict export (dynamo) leaves no tags: runs on one line cannot be told apart by stack traces,
    so the instance is refused rather than merged."""
    model = Looped()
    x = torch.randn(4, 8)
    model(x)
    ep = torch.export.export(model, (x,), strict=True)
    report = fxkern.explain(ep, RuleSet("empty"))
    assert any("more than once" in nm.reason for nm in report.near_misses)
    torch.testing.assert_close(fxkern.apply(ep, RuleSet("empty")).module()(x), model(x))


class InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x, b):
        with fxkern.region(GELU_BIAS):
            y = F.gelu(x + b, approximate="tanh")
            self.acc.add_(b)
        return y


def test_a_region_that_updates_in_place_is_refused():
    ep = torch.export.export(InPlace(), (torch.randn(4, 8), torch.randn(8)))
    report = fxkern.explain(ep, RuleSet("empty"))
    assert any("in place" in nm.reason for nm in report.near_misses)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)

    def forward(self, x, b):
        with fxkern.region(GELU_BIAS):
            y = F.gelu(self.inner(x) + b, approximate="tanh")
        return y


def test_a_region_calling_a_submodule_stays_one_region():
    ep = torch.export.export(Outer(), (torch.randn(4, 8), torch.randn(8)))
    report = fxkern.explain(ep, RuleSet("empty"))
    (rr,) = [r for name, r in report.rules.items() if name.startswith("region@")]
    assert not rr.matches  # four inputs (weight, x, bias, b) do not fit a two-argument op
    assert rr.candidates == 1 and "takes 2 arguments" in rr.near_misses[0].reason


class MultiLine(Block):
    """Block's region, its one statement written over several lines, as black formats a long call."""

    def forward(self, x):
        h = self.lin(x)
        with fxkern.region(GELU_BIAS):
            y = F.gelu(
                h + self.b,
                approximate="tanh",
            )
        return y * 2


def test_a_statement_over_several_lines_is_one_region():
    """Its add is on a later line than the gelu that uses it: the block was cut in two there, the add
    alone replaced by the op and GELU applied twice (found by a review). Strict export (stack traces)
    and the default export (tags) alike."""
    model = MultiLine()
    x = torch.randn(4, 8)
    model(x)
    for strict in (False, True):
        ep = torch.export.export(model, (x,), strict=strict)
        new = fxkern.apply(ep, RuleSet("empty"), verify=True)
        assert count_target(new, GELU_BIAS) == 1
        assert not any(n.target == torch.ops.aten.gelu.default for n in new.graph.nodes)
        torch.testing.assert_close(new.module()(x), model(x))


def gelu_bias_helper(x, b):
    with fxkern.region(GELU_BIAS):
        y = F.gelu(x + b, approximate="tanh")
    return y


class ViaHelper(torch.nn.Module):
    def forward(self, x, b):
        return gelu_bias_helper(x, b) * 2


def test_a_region_in_a_helper_function_is_found():
    """torch.export's default tracing keeps only forward's frame in stack traces; the block's nodes
    are tagged while it runs, so a region in a helper (transformers' eager_attention_forward) is found."""
    x, b = torch.randn(4, 8), torch.randn(8)
    ep = torch.export.export(ViaHelper(), (x, b))
    new = fxkern.apply(ep, RuleSet("empty"), verify=True)
    assert count_target(new, GELU_BIAS) == 1
    torch.testing.assert_close(new.module()(x, b), ViaHelper()(x, b))
    decomposed = fxkern.apply(ep.run_decompositions(), RuleSet("empty"))  # the tags survive decompositions
    assert count_target(decomposed, GELU_BIAS) == 1


def two_sums(x, b):
    return x + b, x * b


TWO_SUMS = fxkern.cuda_kernel_op("fxkern_test::region_two_sums", spec_like(two_sums, n_out=2), reference=two_sums)


class Independent(torch.nn.Module):
    """Two statements with no data between them: one run of the block in two pieces."""

    def forward(self, x, b):
        with fxkern.region(TWO_SUMS):
            s = x + b
            p = x * b
        return s - p


def test_statements_sharing_no_data_are_one_run():
    x, b = torch.randn(4, 8), torch.randn(4, 8)
    model = Independent()
    model(x, b)
    for strict in (False, True):
        ep = torch.export.export(model, (x, b), strict=strict)
        new = fxkern.apply(ep, RuleSet("empty"), verify=True)
        assert count_target(new, TWO_SUMS) == 1, strict
        torch.testing.assert_close(new.module()(x, b), model(x, b))


def add_relu(x, b):
    return torch.relu(x + b)


ADD_RELU = fxkern.cuda_kernel_op("fxkern_test::region_add_relu", spec_like(add_relu), reference=add_relu)


class ByTarget(torch.nn.Module):
    """One ``with fxkern.region(self.op)`` line, run with the target its instance was built with."""

    def __init__(self, op, fn):
        super().__init__()
        self.op, self.fn = op, fn
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with fxkern.region(self.op):
            y = self.fn(x, self.b)
        return y * 2


class TwoTargets(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.g, self.r = ByTarget(GELU_BIAS, gelu_bias_ref), ByTarget(ADD_RELU, add_relu)

    def forward(self, x):
        return self.r(self.g(x))


def test_one_region_line_with_two_targets_calls_each_its_own():
    """The line took the first target it ran with for both blocks, GELU where the code had ReLU (found
    by a review). The default export tags each run with its target; stack traces (strict export)
    cannot tell the blocks apart, which is a near-miss."""
    model, x = TwoTargets(), torch.randn(4, 8)
    new = fxkern.apply(torch.export.export(model, (x,)), RuleSet("empty"), verify=True)
    assert count_target(new, GELU_BIAS) == 1 and count_target(new, ADD_RELU) == 1
    torch.testing.assert_close(new.module()(x), model(x))
    strict = torch.export.export(model, (x,), strict=True)
    report = fxkern.explain(strict, RuleSet("empty"))
    assert not report.matches and any("several targets" in nm.reason for nm in report.near_misses)
    torch.testing.assert_close(fxkern.apply(strict, RuleSet("empty")).module()(x), model(x))


def test_a_bad_target_is_refused_where_the_region_is_written():
    """A string or a function failed at apply time with AttributeError: '_schema' (found by a review)."""
    import pytest

    for bad in ("fxkern_test::region_gelu_bias", gelu_bias_ref):
        with pytest.raises(fxkern.SpecError, match="must be a torch op"):
            fxkern.region(bad)


class OneLine(torch.nn.Module):
    def forward(self, x, b):
        with fxkern.region(GELU_BIAS): y = F.gelu(x + b, approximate="tanh")  # noqa: E701
        return y * 2


def test_a_one_line_region_is_read():
    """`with fxkern.region(op): y = f(x)` was refused as not written as a with statement."""
    x, b = torch.randn(4, 8), torch.randn(8)
    new = fxkern.apply(torch.export.export(OneLine(), (x, b)), RuleSet("empty"), verify=True)
    assert count_target(new, GELU_BIAS) == 1


class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with fxkern.region(GELU_BIAS):
            y = F.gelu(x + self.b, approximate="tanh")
            torch._dynamo.graph_break()
        return y * 2


def test_a_graph_break_inside_a_region_keeps_the_frame_compiled():
    """Dynamo cannot break a graph inside a context object it does not know, so it ran the whole
    forward in eager, silently; under dynamo the region is a nullcontext (found by a review). The
    graph before the break cannot tell that the block ended with it, so the region is reported as
    split, not replaced."""
    model, x = Breaks(), torch.randn(4, 8)
    model(x)  # records the site
    be = fxkern.backend(RuleSet("empty"), inner="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=be)(x), model(x))
    torch._dynamo.reset()
    assert be.reports  # compiled, not skipped
    assert not any(m.rule.startswith("region@") for r in be.reports for m in r.matches)
    assert any("breaks the graph inside the region" in nm.reason for r in be.reports for nm in r.near_misses)


class BreaksMidway(torch.nn.Module):
    def forward(self, x, b):
        with fxkern.region(GELU_BIAS):
            h = x + b
            torch._dynamo.graph_break()
            y = F.gelu(h, approximate="tanh") + b
        return y * 2


def test_neither_half_of_a_region_split_by_a_graph_break_is_replaced():
    """Each half has the op's arity (x, b -> h; h, b -> y): an op call in either place computed the
    whole block from half of it, a wrong result (found by a probe)."""
    model, x, b = BreaksMidway(), torch.randn(4, 8), torch.randn(8)
    want = model(x, b)
    be = fxkern.backend(RuleSet("empty"), inner="aot_eager")
    torch.testing.assert_close(torch.compile(model, backend=be)(x, b), want)
    torch._dynamo.reset()
    split = [nm for r in be.reports for nm in r.near_misses if "breaks the graph inside the region (line" in nm.reason]
    assert len(split) == 2 and not any(r.matches for r in be.reports)


def exp_add(x, b):
    return torch.exp(x) + b


EXP_ADD = fxkern.cuda_kernel_op("fxkern_test::region_exp_add", spec_like(exp_add), reference=exp_add)


class ExpAdd(torch.nn.Module):
    def forward(self, x, b):
        with fxkern.region(EXP_ADD):
            y = torch.exp(x) + b  # both calls start at one column
        return y * 2


def test_a_backward_graph_holds_no_run_of_a_region():
    """aot_autograd's backward nodes carry the stack trace of the op they differentiate: x's gradient
    here (tangent * exp(x)) has the op's arity and read as a run of the block, so the op replaced it
    and gave wrong gradients (found by a probe)."""
    model = ExpAdd()
    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    model(x, b).sum().backward()
    want, x.grad = x.grad, None
    be = fxkern.backend(RuleSet("empty"), inner="aot_eager")
    torch.compile(model, backend=be)(x, b).sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(x.grad, want)
    assert len(be.reports) == 2 and not be.reports[1].matches  # forward, then backward


def test_tags_name_the_site_so_a_saved_program_keeps_its_meaning():
    """A tag is the site's file, line and target, the same in every process: a counter in it made a
    program saved in one process take another region's op after loading in another (found by a review)."""
    x, b = torch.randn(4, 8), torch.randn(8)
    ep = torch.export.export(ViaHelper(), (x, b))
    tags = {(n.meta.get("custom") or {}).get("fxkern_region") for n in ep.graph.nodes if n.op == "call_function"}
    from fxkern.region import sites

    line = gelu_bias_helper.__code__.co_firstlineno + 1  # the helper's `with` line
    site = next(s for s in sites() if s.op is GELU_BIAS and s.filename == __file__ and s.first == line)
    assert any(t and t.startswith(f"{__file__}:{site.first}:{GELU_BIAS}#") for t in tags)


def test_a_saved_program_s_regions_are_replaced_in_a_fresh_process(tmp_path):
    """The tags travel with torch.export.save, but only sites recorded in the process were looked for:
    loaded where the block never ran, the region was left in place, unreported (found by a probe)."""
    x, b = torch.randn(4, 8), torch.randn(8)
    path = tmp_path / "region.pt2"
    torch.export.save(torch.export.export(ViaHelper(), (x, b)), str(path))
    script = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}]\n"
              "import torch, fxkern, test_region\n"
              "from fxkern.region import sites\n"
              f"ep = torch.export.load({str(path)!r})\n"
              "assert not sites(), sites()\n"
              "new = fxkern.apply(ep, fxkern.RuleSet('empty'), verify=True)\n"
              "print(sum(n.target is test_region.GELU_BIAS.default for n in new.graph.nodes))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "1", proc.stdout


def spec_block(spec, name):
    class SpecBlock(torch.nn.Module):
        def forward(self, x, b):
            with fxkern.region(spec, name=name, reference=gelu_bias_ref if name.endswith("gelu") else add_relu):
                y = F.gelu(x + b, approximate="tanh") if name.endswith("gelu") else torch.relu(x + b)
            return y

    return SpecBlock()


def test_two_kernel_specs_on_one_line_are_two_sites():
    """A KernelSpec target was keyed as None: the second spec's blocks ran the first spec's op."""
    import pytest

    x, b = torch.randn(4, 8), torch.randn(8)
    gelu = spec_block(spec_like(gelu_bias_ref), "fxkern_test::two_specs_gelu")
    relu = spec_block(spec_like(add_relu), "fxkern_test::two_specs_relu")
    for model, fn in ((gelu, gelu_bias_ref), (relu, add_relu)):
        new = fxkern.apply(torch.export.export(model, (x, b)), RuleSet("empty"), verify=True)
        torch.testing.assert_close(new.module()(x, b), fn(x, b))
    # the block's reference (its own code) also runs CUDA calls past the kernel's 32-bit sizes
    assert fxkern.kernel_op("fxkern_test::two_specs_gelu").past_limits == "reference"
    with pytest.raises(fxkern.RegistrationError):  # the same name for another spec: a clear error
        spec_block(spec_like(add_relu), "fxkern_test::two_specs_gelu")(x, b)


def quick_gelu_ref(h):
    return h * torch.sigmoid(1.702 * h)


QUICK_GELU = fxkern.cuda_kernel_op("fxkern_test::region_quick_gelu", spec_like(quick_gelu_ref), reference=quick_gelu_ref)


class QuickGelu(torch.nn.Module):
    def forward(self, h):
        with fxkern.region(QUICK_GELU):
            a = h * torch.sigmoid(1.702 * h)  # CLIP's one line: aten.mul twice
        return a + 1


class QuickGeluTwoLines(torch.nn.Module):
    def forward(self, h):
        with fxkern.region(QUICK_GELU):
            s = torch.sigmoid(1.702 * h)
            a = h * s
        return a + 1


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_line_calling_an_op_twice_is_one_run_under_torch_compile(inner):
    """CLIP's quick GELU calls mul twice on one line. Python 3.11+ stack traces under torch 2.13 mark
    where on the line each call is, so the two muls are two calls of one run, not a loop's two runs
    (it was refused, and the user told to split the line; found by a usability test). Where the marks
    are missing (torch 2.11's dynamo, Python 3.10) it is still refused, with that advice."""
    x = torch.randn(4, 8)
    for model in (QuickGelu(), QuickGeluTwoLines()):
        model(x)  # records the site
        be = fxkern.backend(RuleSet("empty"), inner=inner)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend=be)(x), model(x))
        torch._dynamo.reset()
        matched = bool([m for r in be.reports for m in r.matches])
        if (sys.version_info >= (3, 11) and torch.__version__ >= "2.13") or isinstance(model, QuickGeluTwoLines):
            assert matched, type(model).__name__
        else:
            reasons = [nm.reason for r in be.reports for rr in r.rules.values() for nm in rr.near_misses]
            assert matched or any("write it as two statements" in reason for reason in reasons), reasons


@pytest.mark.parametrize("grad", [False, True])
def test_a_call_inductor_decomposes_is_one_call_of_the_run(grad):
    """inductor writes the tanh GELU as ten ops, five of them muls, all from one call: the region was
    refused as run more than once under the default backend (found by a probe). torch 2.13's nodes
    name the call they came from (from_node); torch 2.11's inductor nodes do not, and it is refused."""
    model, x = Block(), torch.randn(4, 8)  # its region's tanh GELU
    want = model(x)
    be = fxkern.backend(RuleSet("empty"), inner="inductor")
    with torch.set_grad_enabled(grad):
        got = torch.compile(model, backend=be)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    matched = [m for r in be.reports for m in r.matches if m.rule.startswith("region@")]
    if torch.__version__ >= "2.13":
        assert matched, [str(r) for r in be.reports]
    else:  # torch 2.11's decompositions keep no from_node link to the call: refused, as before
        assert matched or any("more than once" in nm.reason for r in be.reports for nm in r.near_misses)


def compiled_reports(model, *args, inner):
    """(compiled output, eager output, the backend's reports) of ``model``, its region's site recorded."""
    model(*args)
    be = fxkern.backend(RuleSet("empty"), inner=inner)
    with torch.no_grad():
        got, want = torch.compile(model, backend=be)(*args), model(*args)
    torch._dynamo.reset()
    return got, want, be.reports


def test_a_region_whose_value_the_backward_saves_says_what_to_do():
    """Training under aot_eager: the forward graph also returns gelu's input for the backward, so
    the block has two outputs and the op one. The reason said only "returns 1 outputs, the pattern
    2" (found by a usability test)."""
    model, x = Block(), torch.randn(4, 8)
    model(x)
    be = fxkern.backend(RuleSet("empty"), inner="aot_eager")
    torch.compile(model, backend=be)(x).sum().backward()
    torch._dynamo.reset()
    reasons = [nm.reason for r in be.reports for nm in r.near_misses]
    assert not [m for r in be.reports for m in r.matches]
    assert any("autograd saves for the backward" in r and "torch.no_grad()" in r for r in reasons), reasons


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_calls_of_two_ops_starting_at_one_column_are_one_run(inner):
    """dynamo's column markers give where a call starts, not where it ends: exp and add here share
    a start, and the block was refused as a loop (found by a review). Calls of one place and one op
    are a repeat; of one place and two ops, two calls."""
    got, want, reports = compiled_reports(ExpAdd(), torch.randn(4, 8), torch.randn(4, 8), inner=inner)
    torch.testing.assert_close(got, want)
    assert [m for r in reports for m in r.matches if m.rule.startswith("region@")], [str(r) for r in reports]


def two_exp_or_tanh(h):
    return 2 * torch.where(h.sum() > 0, torch.exp(h), torch.tanh(h))


TWO_EXP_OR_TANH = fxkern.cuda_kernel_op("fxkern_test::region_two_exp_or_tanh", spec_like(two_exp_or_tanh),
                                        reference=two_exp_or_tanh)


class CondInRegion(torch.nn.Module):
    def forward(self, h):
        pred = h.sum() > 0
        with fxkern.region(TWO_EXP_OR_TANH):
            y = 2 * torch.cond(pred, lambda t: torch.exp(t), lambda t: torch.tanh(t), (h,))
        return y


def two_exp(x):
    return 2 * torch.exp(x)


TWO_EXP = fxkern.cuda_kernel_op("fxkern_test::region_two_exp", spec_like(two_exp), reference=two_exp)


def energy(x):
    with fxkern.region(TWO_EXP):
        y = 2 * torch.exp(x)
    return y.sum()


class GradOfRegion(torch.nn.Module):
    def forward(self, x):
        return torch.func.grad(energy)(x) * 3


@pytest.mark.parametrize("model, reason", [(CondInRegion(), "higher-order op's subgraph"),
                                           (GradOfRegion(), "removed part of the block")],
                         ids=["cond branches", "dead code"])
def test_pieces_of_a_run_inductor_hands_over_are_not_replaced(model, reason):
    """inductor passes each torch.cond branch to the pass as a graph of its own, and under
    torch.func.grad the block's mul is dead code, removed before the pass: each piece had the op's
    arity and was replaced by the whole block's op, a wrong result (found by a review)."""
    got, want, reports = compiled_reports(model, torch.randn(4, 8) * 0.1, inner="inductor")
    torch.testing.assert_close(got, want)
    assert not [m for r in reports for m in r.matches]
    assert any(reason in nm.reason for r in reports for nm in r.near_misses), [str(r) for r in reports]


def test_a_site_recorded_after_the_compile_is_checked_at_the_recompile():
    """Compiled first, the block's site is recorded by the eager call after: the backend recompiles,
    and used the facts it read before the site existed, so the dead-code piece was replaced, and
    inductor's cache handed that compile to later processes (found by a review)."""
    model, x = GradOfRegion(), torch.randn(4, 8) * 0.1
    be = fxkern.backend(RuleSet("empty"), inner="inductor")
    compiled = torch.compile(model, backend=be)
    compiled(x)  # no site yet
    want = model(x)  # records it
    got = compiled(x)  # recompiles
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert not [m for r in be.reports for m in r.matches]


def exp_times_w(x, w):
    return torch.exp(x) * w


EXP_TIMES_W = fxkern.cuda_kernel_op("fxkern_test::region_exp_times_w", spec_like(exp_times_w), reference=exp_times_w)


class NoOpCalls(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.w, self.drop = how, torch.nn.Parameter(torch.randn(8)), torch.nn.Dropout(0.1)

    def forward(self, x):
        with fxkern.region(EXP_TIMES_W):
            if self.how == "dropout":
                a = self.drop(x)
            elif self.how == "flatten":
                a = torch.flatten(x, 1)
            else:
                a = torch.clone(x)
            e = torch.exp(a)
            y = e * self.w
        return y + 1


class CheckpointedLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(NoOpCalls("clone") for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("model, replaced", [(NoOpCalls("dropout").eval(), 1), (NoOpCalls("flatten"), 1),
                                             (NoOpCalls("clone"), 1), (CheckpointedLayers(), 2)],
                         ids=["dropout in eval", "flatten of a flat tensor", "clone", "checkpointed layers"])
def test_a_block_whose_no_op_calls_the_compiler_drops_is_still_whole(model, replaced):
    """Calls a compiler drops as no-ops leave the run whole; activation checkpointing's subgraph is
    inlined by aot_autograd. The check for removed calls refused all of these (found by a review)."""
    got, want, reports = compiled_reports(model, torch.randn(4, 8) * 0.1, inner="inductor")
    torch.testing.assert_close(got, want)
    assert len([m for r in reports for m in r.matches]) == replaced, [str(r) for r in reports]


def test_a_call_inductor_folds_into_a_constant_leaves_no_run():
    """With inductor's freezing, sigmoid(self.b) is folded before the pass, and the add left became
    op(h, constant) = h + sigmoid(sigmoid(b)) (found by a review)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(freezing=True):
        got, want, reports = compiled_reports(HoistedLoopedOnce().eval(), torch.randn(4, 8), inner="inductor")
    torch.testing.assert_close(got, want)
    assert not [m for r in reports for m in r.matches]
    assert any("removed part of the block" in nm.reason for r in reports for nm in r.near_misses)


def test_the_compile_cache_key_holds_the_region_sites():
    """Inductor's FX graph cache is keyed by the pass's uuid: a graph compiled before a region was
    recorded, or with another target on its line, was handed back unrewritten or with the old op (a
    wrong result when that op was wrong; found by a usability test). The site and its target are in
    the key, and a newly recorded site makes the backend recompile its graphs."""
    from fxkern.backends.torch_compile import _rule_key
    from fxkern.region import site_count

    other = fxkern.cuda_kernel_op("fxkern_test::region_quick_gelu_other", spec_like(quick_gelu_ref),
                                  reference=quick_gelu_ref)

    def block(target):
        with fxkern.region(target):
            return torch.sigmoid(1.702 * x) * x

    x = torch.randn(4, 8)
    be = fxkern.backend(RuleSet("empty"))
    before, seen = _rule_key([]), be.fingerprint()
    block(QUICK_GELU)
    with_one = _rule_key([])
    block(other)  # the same line, another target: another site
    assert len({before, with_one, _rule_key([])}) == 3
    assert be.fingerprint() != seen and site_count() >= 2


class QuickGeluLooped(torch.nn.Module):
    def forward(self, h):
        for _ in range(2):
            with fxkern.region(QUICK_GELU):
                h = h * torch.sigmoid(1.702 * h)
        return h


def sigmoid_bias_ref(b, h):
    return h + torch.sigmoid(b)


SIGMOID_BIAS = fxkern.cuda_kernel_op("fxkern_test::region_sigmoid_bias", spec_like(sigmoid_bias_ref, same_as="h"),
                                     reference=sigmoid_bias_ref)


class HoistedLooped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, h):
        for _ in range(2):
            with fxkern.region(SIGMOID_BIAS):
                h = h + torch.sigmoid(self.b)  # loop-invariant: inductor's training graph keeps one sigmoid
        return h


class HoistedLoopedOnce(HoistedLooped):  # the block run once, no loop
    def forward(self, h):
        with fxkern.region(SIGMOID_BIAS):
            h = h + torch.sigmoid(self.b)
        return h * 2


def exp_after_add_ref(h):
    return (h + 1).exp()


EXP_AFTER_ADD = fxkern.cuda_kernel_op("fxkern_test::region_exp_after_add", spec_like(exp_after_add_ref),
                                      reference=exp_after_add_ref)


class PrunedLooped(torch.nn.Module):
    def forward(self, h):
        for _ in range(2):
            with fxkern.region(EXP_AFTER_ADD):
                h = h + 1
                y = h.exp()  # only the last run's is used: the first run's exp is dead code
        return y


@pytest.mark.parametrize("model, inner, grad", [(QuickGeluLooped(), "aot_eager", False),
                                               (HoistedLooped(), "inductor", True),
                                               (PrunedLooped(), "inductor", False)],
                         ids=["same op twice", "hoisted", "pruned"])
def test_a_looped_block_under_torch_compile_is_refused_not_merged(model, inner, grad):
    """Two runs in one graph, on one line: a loop of the quick GELU line leaves mul 4 times and sigmoid
    twice, a loop whose invariant sigmoid inductor keeps once leaves sigmoid once and add twice, and a
    loop whose first exp is dead code leaves add twice and exp once; rules that accepted a line calling
    an op twice merged them into one op call, a wrong result (found by two reviews)."""
    x = torch.randn(4, 8)
    model(x)  # records the site
    be = fxkern.backend(RuleSet("empty"), inner=inner)
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(torch.compile(model, backend=be)(x), model(x))
    torch._dynamo.reset()
    assert not [m for r in be.reports for m in r.matches]
    assert any("more than once" in nm.reason or "removed part of the block" in nm.reason  # inductor's CSE: one sigmoid
               for r in be.reports for rr in r.rules.values() for nm in rr.near_misses)


class UnusedResult(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with fxkern.region(GELU_BIAS):
            F.gelu(x + self.b, approximate="tanh")  # its result never used
        return x * 2


def test_a_region_whose_result_is_unused_says_so():
    """It said "outputs [], but ... takes 2 arguments", which pointed at the inputs (found by a probe)."""
    ep = torch.export.export(UnusedResult(), (torch.randn(4, 8),))
    report = fxkern.explain(ep, RuleSet("empty"))
    (miss,) = [m for m in report.near_misses if m.rule.startswith("region@")]
    assert "nothing the block computes is used after it" in miss.reason
    assert fxkern.apply(ep, RuleSet("empty")) is ep


def linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def attention_kqv(k, q, v):
    return torch.softmax(q @ k.mT, -1) @ v  # k first: torch.export's graph reads k.mT before the matmul


LINEAR_GELU = fxkern.cuda_kernel_op("fxkern_test::region_linear_gelu", spec_like(linear_gelu), reference=linear_gelu)
ATTENTION_KQV = fxkern.cuda_kernel_op("fxkern_test::region_attention_kqv", spec_like(attention_kqv),
                                      reference=attention_kqv)


class LinearGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with fxkern.region(LINEAR_GELU):
            y = F.gelu(F.linear(x, self.w, self.b))
        return y * 2


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        with fxkern.region(ATTENTION_KQV):
            s = q @ k.mT  # two statements: torch 2.11's dynamo traces carry no columns to tell two matmuls of a line apart
            y = torch.softmax(s, -1) @ v
        return y + 1


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_region_inputs_reach_the_op_in_one_order_in_every_graph(inner):
    """A region's inputs map to the op's arguments in the order torch.export's graph first reads them.
    Compiled graphs broke it (found by a probe): aot_autograd writes linear(x, W, B) as t(W), addmm(B,
    x, ...), and the op got (W, B, x); inductor moved k.mT after q's expand, and the op got (q, k, v)
    where the exported program gives (k, q, v). Under torch.compile the order is read from dynamo's
    graph; after run_decompositions(), where no such graph is, a call decomposed before it reads two
    inputs is refused."""
    x = torch.randn(8, 8)
    model = LinearGelu().eval().requires_grad_(False)
    model(x)
    new = fxkern.apply(torch.export.export(model, (x,)), RuleSet("empty"), verify=True)
    assert count_target(new, LINEAR_GELU) == 1
    report = fxkern.explain(torch.export.export(model, (x,)).run_decompositions(), RuleSet("empty"))
    assert any("are first read by one call that this graph holds as" in m.reason and "cannot be read here" in m.reason
               for m in report.near_misses), str(report)
    got, want, reports = compiled_reports(model, x, inner=inner)
    torch.testing.assert_close(got, want)
    assert [m for r in reports for m in r.matches if m.rule.startswith("region@")], [str(r) for r in reports]

    q, k, v = (torch.randn(2, 4, 4) for _ in range(3))
    model = Attention()
    new = fxkern.apply(torch.export.export(model, (q, k, v)), RuleSet("empty"), verify=True)
    assert count_target(new, ATTENTION_KQV) == 1
    got, want, reports = compiled_reports(model, q, k, v, inner=inner)
    torch.testing.assert_close(got, want)
    assert [m for r in reports for m in r.matches if m.rule.startswith("region@")], [str(r) for r in reports]


def scaled_relu(x, alpha: float):
    return torch.relu(x * alpha)


SCALED_RELU = fxkern.cuda_kernel_op("fxkern_test::region_scaled_relu", spec_like(scaled_relu), reference=scaled_relu)


class ScaledRelu(torch.nn.Module):
    def forward(self, x):
        with fxkern.region(SCALED_RELU):
            y = torch.relu(x * 0.5)
        return y + 1


def test_a_region_for_an_op_taking_scalars_says_a_region_passes_tensors_only():
    """It said only "the region has inputs ['x'] ... but the op takes 2 arguments" (found by a probe)."""
    model = ScaledRelu()
    ep = torch.export.export(model, (torch.randn(4, 8),))
    (miss,) = [m for m in fxkern.explain(ep, RuleSet("empty")).near_misses if m.rule.startswith("region@")]
    assert "takes non-tensor arguments ['alpha'] too" in miss.reason and "fxkern.replace" in miss.reason


class NoOpCast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with fxkern.region(SIGMOID_TIMES_TWICE):
            h = x.float()  # a float32 x: a node in the exported program, gone from compiled graphs
            w2 = self.w * 2
            y = torch.sigmoid(h) * w2
        return y + 1


def sigmoid_times_twice(x, w):
    return torch.sigmoid(x) * (w * 2)


SIGMOID_TIMES_TWICE = fxkern.cuda_kernel_op("fxkern_test::region_sigmoid_times_twice", spec_like(sigmoid_times_twice),
                                            reference=sigmoid_times_twice)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_no_op_cast_the_compiler_drops_leaves_the_input_order_alone(inner):
    """x.float() of a float32 x reads x first in the exported program; aot_autograd drops it, and the
    op got (w, x) (found by a review)."""
    x = torch.randn(4, 8)
    model = NoOpCast().eval().requires_grad_(False)
    assert count_target(fxkern.apply(torch.export.export(model, (x,)), RuleSet("empty"), verify=True),
                        SIGMOID_TIMES_TWICE) == 1
    got, want, reports = compiled_reports(model, x, inner=inner)
    torch.testing.assert_close(got, want)
    assert [m for r in reports for m in r.matches if m.rule.startswith("region@")], [str(r) for r in reports]


class _Gelu(torch.nn.Module):
    """A block whose region's result is its own result (``then_double=False``) or is doubled first."""

    def __init__(self, then_double):
        super().__init__()
        self.b, self.then_double = torch.nn.Parameter(torch.randn(8)), then_double

    def forward(self, h):
        with fxkern.region(GELU_BIAS):
            y = F.gelu(h + self.b, approximate="tanh")
        return y * 2 if self.then_double else y


class _Calls(torch.nn.Module):
    def __init__(self, then_double):
        super().__init__()
        self.lin, self.blk = torch.nn.Linear(8, 8), _Gelu(then_double)

    def forward(self, x):
        return self.blk(self.lin(x)) * 3


@pytest.mark.parametrize("then_double", [False, True], ids=["region returns the call's result", "region inside"])
def test_a_region_and_a_preserved_module_call(then_double):
    """A region whose result a preserved module call returns (``preserve_module_call_signature``) stays,
    a near-miss naming that value: ``unflatten`` finds the call's result by name, and apply raised
    SpecViolationError renaming it. A region inside the call, its result not the call's, is replaced."""
    model = _Calls(then_double).eval()
    x = torch.randn(4, 8)
    ep = torch.export.export(model, (x,), preserve_module_call_signature=("blk",))
    new = fxkern.apply(ep, RuleSet("empty"))
    assert count_target(new, GELU_BIAS) == (1 if then_double else 0)
    torch.testing.assert_close(torch.export.unflatten(new)(x), model(x))
    misses = fxkern.explain(ep, RuleSet("empty")).near_misses
    assert any("preserved module call" in m.reason for m in misses) != then_double
