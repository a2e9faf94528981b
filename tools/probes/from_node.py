"""Which graphs a compile hands fxkern's pass carry ``from_node`` (the traced call each node came
from): the region pass orders a block's inputs by it. Prints, per graph, each call node's target and
the root of its from_node history. Run: python tools/probes/from_node.py"""

import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor import config


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.W = torch.nn.Parameter(torch.randn(8, 8))
        self.B = torch.nn.Parameter(torch.randn(8))

    def forward(self, x, a, b, w):
        return F.gelu(F.linear(x, self.W, self.B)) + torch.lerp(a, b, w)


def root(n):
    src, sources = None, n.meta.get("from_node")
    while sources:
        src = sources[-1]
        sources = getattr(src, "from_node", None)
    return getattr(src, "name", None)


def show(title, graph):
    print(f"== {title} (torch {torch.__version__})")
    for n in graph.nodes:
        if n.op == "call_function":
            print(f"  {n.name:12} {str(n.target):28} from_node root: {root(n)}")


def aot(gm, example):
    return aot_module_simplified(gm, example, fw_compiler=lambda g, _: (show("aot_autograd forward", g.graph), g)[1])


model = M().eval().requires_grad_(False)
args = tuple(torch.randn(4, 8, device="cuda" if torch.cuda.is_available() else "cpu") for _ in range(4))
model.to(args[0].device)
torch.compile(model, backend=aot)(*args)
torch._dynamo.reset()
config.post_grad_custom_post_pass = lambda g: show("inductor post-grad", g)
torch.compile(model)(*args)
