"""Matching + rewriting time on large graphs (issue: rules).

Graphs of about 1k, 10k and 50k nodes: a repeated transformer-like block
(residual add, RMSNorm, bias+GELU+residual, SwiGLU), built with torch.fx
directly in torch.export's ATen IR. Three rules, three rewriters, one run:

* fxkern.apply (three rules at once, safety checks included);
* torch.fx.subgraph_rewriter.replace_pattern_with_filters, once per pattern;
* inductor's PatternMatcherPass with register_replacement.

The rewriter and inductor get their patterns traced in the graph's IR (the
same export trace fxkern uses, with the graph's literal eps), as they would
find nothing otherwise.

A second table times what a user's ``apply(ep)`` does on a real model: every
rule of fxkern.library, in both the export and core ATen IRs, on transformers'
Llama exported at toy width with 25 to 400 decoder layers (about 2k to 29k
nodes; most nodes are near some rule's anchor, few are matched).

    python benchmarks/matching.py [--sizes 1000 10000 50000] [--llama-layers 25 100 400]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import fxkern  # noqa: E402
from fxkern import RuleSet  # noqa: E402
from helpers import spec_like  # noqa: E402

aten = torch.ops.aten
EPS = 1e-6


def rmsnorm(x, w, eps: float):
    v = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(v + eps))


def bias_gelu_residual(x, b, r):
    return F.gelu(x + b, approximate="tanh") + r


def swiglu(a, b):
    return F.silu(a) * b


PATTERNS = [rmsnorm, bias_gelu_residual, swiglu]


def build_graph(n_nodes: int) -> fx.GraphModule:
    """Blocks of 15 nodes: add, rmsnorm (6), bias+gelu+residual (3), swiglu (2), 3 others."""
    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    r = x
    outs = []
    for _ in range(max(1, n_nodes // 15)):
        h = g.call_function(aten.add.Tensor, (x, r))
        p = g.call_function(aten.pow.Tensor_Scalar, (h, 2))
        m = g.call_function(aten.mean.dim, (p, [-1], True))
        a = g.call_function(aten.add.Tensor, (m, EPS))
        q = g.call_function(aten.rsqrt.default, (a,))
        n1 = g.call_function(aten.mul.Tensor, (h, q))
        n = g.call_function(aten.mul.Tensor, (w, n1))
        t = g.call_function(aten.add.Tensor, (n, b))
        ge = g.call_function(aten.gelu.default, (t,), {"approximate": "tanh"})
        res = g.call_function(aten.add.Tensor, (ge, h))
        s = g.call_function(aten.silu.default, (res,))
        sw = g.call_function(aten.mul.Tensor, (s, n))
        x = g.call_function(aten.tanh.default, (sw,))
        r = g.call_function(aten.neg.default, (res,))
        outs.append(g.call_function(aten.sigmoid.default, (x,)))
    g.output((x, r))
    gm = fx.GraphModule(torch.nn.Module(), g)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    vals = {"x": torch.randn(4, 8), "w": torch.randn(8), "b": torch.randn(8)}
    env = {}
    with mode:  # meta['val'] as fake tensors, as an exported graph carries them
        for node in g.nodes:
            if node.op == "placeholder":
                env[node] = mode.from_tensor(vals[node.name])
            elif node.op == "call_function":
                env[node] = node.target(*[env[a] if isinstance(a, fx.Node) else a for a in node.args], **node.kwargs)
            else:
                continue
            node.meta["val"] = env[node]
    return gm


def fxkern_rules():
    rs = RuleSet("bench")
    for p in PATTERNS:
        fxkern.replace(p, spec_like(p), name=f"bench::{p.__name__}", rules=rs)
    return rs


def count_ops(gm, rs):
    targets = {r.op.default for r in rs}
    return sum(1 for n in gm.graph.nodes if n.target in targets)


def fxkern_breakdown(gm, rs):
    """(analysis s, rewrite s, recompile s) of one in-place apply, timed stage by stage."""
    from fxkern import rewrite

    with rewrite._collector_paused():  # as apply runs them
        t0 = time.perf_counter()
        accepted, _, pos = rewrite.analyse(gm, rs, ("export",))
        t1 = time.perf_counter()
        rewrite._rewrite(gm.graph, accepted, pos)
        t2 = time.perf_counter()
        gm.recompile()
        t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def run_fxkern_pass(gm, rs):
    """The compiler pass fxkern.backend runs inside torch.compile: rewrite the graph, no codegen."""
    from fxkern import rewrite

    t0 = time.perf_counter()
    rewrite.rewrite_graph(gm.graph, rs, ("export",))
    return time.perf_counter() - t0


def run_fxkern(gm, rs, inplace=True):
    t0 = time.perf_counter()
    new = fxkern.apply(gm, rs, ir="export", inplace=inplace)
    return time.perf_counter() - t0, count_ops(new, rs)


def _traced_pattern(p, rule):
    """The pattern's export trace as a GraphModule, with the graph's eps in place of the capture."""
    from fxkern import patterns
    from fxkern.patterns import _export_graph

    fn = (lambda x, w: rmsnorm(x, w, EPS)) if p is rmsnorm else p
    tensor_params = [q for q in patterns.pattern_params(p) if q.kind == "tensor"]
    graph = _export_graph(fn, tensor_params, [torch.randn(4, 8) for _ in tensor_params], decompose=False)
    for node in list(graph.nodes):
        if patterns.is_inert(node):
            graph.erase_node(node)
    return fx.GraphModule(torch.nn.Module(), graph), len(tensor_params)


def run_fx_rewriter(gm, rs):
    from torch.fx.subgraph_rewriter import replace_pattern_with_filters

    total = 0.0
    found = 0
    for p, rule in zip(PATTERNS, rs):
        pattern_gm, n = _traced_pattern(p, rule)
        rg = fx.Graph()
        phs = [rg.placeholder(f"a{i}") for i in range(n)]
        args = (phs[0], phs[1], EPS) if p is rmsnorm else tuple(phs)
        rg.output(rg.call_function(rule.op.default, args))
        replacement = fx.GraphModule(torch.nn.Module(), rg)
        t0 = time.perf_counter()
        found += len(replace_pattern_with_filters(gm, pattern_gm, replacement))
        total += time.perf_counter() - t0
    return total, found


def _inductor_pair(p, op):
    """(search, replacement, example inputs) for one pattern; a function per pattern binds its op."""
    if p is rmsnorm:
        return (lambda x, w: rmsnorm(x, w, EPS)), (lambda x, w: op(x, w, EPS)), [torch.randn(4, 8), torch.randn(8)]
    if p is bias_gelu_residual:
        return p, (lambda x, b, r: op(x, b, r)), [torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)]
    return p, (lambda a, b: op(a, b)), [torch.randn(4, 8), torch.randn(4, 8)]


def run_inductor(gm, rs):
    from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement
    from torch.fx.experimental.proxy_tensor import make_fx

    pm = PatternMatcherPass()

    def trace_fn(fn, args, **_):  # no decompositions: the graph is in export's ATen IR
        return make_fx(fn)(*args)

    for p, rule in zip(PATTERNS, rs):
        search, repl, ex = _inductor_pair(p, rule.op.default)
        register_replacement(search, repl, ex, trace_fn, [pm])
    t0 = time.perf_counter()
    count = pm.apply(gm.graph)
    return time.perf_counter() - t0, count


def llama_program(layers: int) -> torch.export.ExportedProgram:
    """transformers' Llama with ``layers`` decoder layers, toy width (hidden 64, 4 heads, 2 key/value
    heads), exported in float32 as a user would (``use_cache=False``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    return torch.export.export(model, (torch.randint(0, 128, (2, 16)),), kwargs={"use_cache": False})


def run_library_pass(ep: torch.export.ExportedProgram, rules) -> tuple:
    """(seconds, ops placed) of the library's pass on a copy of ``ep``'s graph, in the IRs ``apply(ep)``
    looks in (the pass alone: no program copy, no codegen)."""
    from fxkern import rewrite

    gm = copy.deepcopy(ep.graph_module)
    t0 = time.perf_counter()
    rewrite.rewrite_graph(gm.graph, rules, rewrite.EXPORT_IRS)
    seconds = time.perf_counter() - t0
    return seconds, sum(1 for n in gm.graph.nodes if getattr(n.target, "namespace", None) == "fxkern_lib")


def llama_rows(layer_counts):
    """(layers, nodes, median pass s, matches) for each layer count, the library's rules traced first."""
    from fxkern import library

    rules = library.rules()
    rows = []
    for layers in layer_counts:
        ep = llama_program(layers)
        if not rows:
            fxkern.apply(ep, rules)  # the patterns' traces, once a process
        runs = [run_library_pass(ep, rules) for _ in range(3)]
        rows.append((layers, len(ep.graph.nodes), statistics.median(t for t, _ in runs), runs[0][1]))
        print(rows[-1], flush=True)
    return rows, len(list(rules))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--slow-limit", type=int, default=50000, help="largest size the fx rewriter is run at")
    parser.add_argument("--llama-layers", type=int, nargs="*", default=[25, 100, 400])
    parser.add_argument("--section-out", type=Path, default=None)
    args = parser.parse_args(argv)
    rs = fxkern_rules()
    # warm: trace every pattern once (a per-process cost, paid at the first apply)
    t0 = time.perf_counter()
    fxkern.apply(build_graph(100), rs, ir="export")
    warm_s = time.perf_counter() - t0
    rows = []
    for size in args.sizes:
        base = build_graph(size)
        n_nodes = len(base.graph.nodes)
        fx_times = [run_fxkern(build_graph(size), rs) for _ in range(3)]
        t_fx = statistics.median(t for t, _ in fx_times)
        found_fx = fx_times[0][1]
        t_pass = statistics.median(run_fxkern_pass(build_graph(size), rs) for _ in range(3))
        t_copy = run_fxkern(build_graph(size), rs, inplace=False)[0]
        stages = fxkern_breakdown(build_graph(size), rs)
        t_rw = found_rw = t_ind = found_ind = None
        if size <= args.slow_limit:
            t_rw, found_rw = run_fx_rewriter(build_graph(size), rs)
        try:
            t_ind, found_ind = run_inductor(build_graph(size), rs)
        except Exception as exc:  # report, keep the other columns
            print(f"inductor pattern matcher failed at {size}: {type(exc).__name__}: {exc}")
        rows.append((n_nodes, t_pass, t_fx, found_fx, t_copy, t_rw, found_rw, t_ind, found_ind, stages))
        print(rows[-1], flush=True)
    fmt = lambda t: "-" if t is None else f"{t:.3f}"  # noqa: E731
    lines = [
        "## Matching and rewriting",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/matching.py`.",
        f"Three rules (RMSNorm, bias+GELU+residual, SwiGLU) on repeated 15-node blocks; first-apply tracing "
        f"of the three patterns (once per process): {warm_s:.2f} s, not included below. fxkern, medians of 3: "
        f"\"pass\": the graph pass `fxkern.backend` runs inside torch.compile (match, safety checks, rewrite; "
        f"inductor generates the code after it); \"apply\": `apply(gm, inplace=True)`, the same plus `gm.recompile()` "
        f"(FX Python codegen, which the fx rewriter also pays), the like-for-like comparison with the rewriter; "
        f"\"with copy\": the default `apply`, which leaves its input untouched. Others: one run, each pattern in turn.",
        "",
        "| nodes | fxkern pass s | fxkern apply s | fxkern matches | apply us/node | fxkern with copy s | fx rewriter s | rewriter matches | speedup (apply) | inductor s | inductor matches | speedup (pass) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    stage_lines = ["", "fxkern by stage (one in-place apply): analysis (match, checks, overlaps) / rewrite / recompile (FX codegen), seconds:", ""]
    for n, tp, t, f, tc, trw, frw, tind, find, (ta, tr, tk) in rows:
        stage_lines.append(f"- {n} nodes: {ta:.3f} / {tr:.3f} / {tk:.3f}")
    for n, tp, t, f, tc, trw, frw, tind, find, _ in rows:
        sp_rw = "-" if trw is None else f"{trw / t:.1f}x"
        sp_ind = "-" if tind is None else f"{tind / tp:.0f}x"
        lines.append(f"| {n} | {tp:.3f} | {t:.3f} | {f} | {t / n * 1e6:.1f} | {tc:.3f} | {fmt(trw)} | {frw if frw is not None else '-'} | {sp_rw} "
                     f"| {fmt(tind)} | {find if find is not None else '-'} | {sp_ind} |")
    if args.llama_layers:
        llama, n_rules = llama_rows(args.llama_layers)
        stage_lines += [
            "",
            f"fxkern.library ({n_rules} rules) on transformers' Llama exports (toy width, float32), the pass `apply(ep)` "
            f"runs (export and core ATen IRs; no copy, no codegen), median of 3:",
            "",
            "| layers | nodes | library pass s | ops placed | us/node |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ] + [f"| {layers} | {n} | {t:.3f} | {found} | {t / n * 1e6:.1f} |" for layers, n, t, found in llama]
    body = "\n".join(lines + stage_lines)
    common.emit("matching", body, args.section_out)


if __name__ == "__main__":
    main()
