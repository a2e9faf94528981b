"""fxkern.region: a marked block of model code becomes one op call after plain torch.export."""

import torch
import torch.nn.functional as F

import fxkern
from fxkern import RuleSet
from helpers import count_target, spec_like


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
    def forward(self, x):
        for _ in range(2):
            with fxkern.region(GELU_BIAS):
                x = F.gelu(x + 1.0, approximate="tanh")
        return x


def test_a_block_run_twice_in_a_chain_is_refused_not_merged():
    model = Looped()
    x = torch.randn(4, 8)
    model(x)
    ep = torch.export.export(model, (x,))
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
