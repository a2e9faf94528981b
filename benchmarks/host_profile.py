"""Where the host time of one small fxkern op call goes (a diagnosis aid for the host-overhead goal).

    python benchmarks/host_profile.py            # an example op, by launch path, and its profile
    python benchmarks/host_profile.py --library  # each op the demo model runs, against its pattern in eager
    python benchmarks/host_profile.py --model    # the rewritten demo model's forward, by function
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import host_us  # noqa: E402

import fxkern  # noqa: E402
import seven_cases  # noqa: E402
from fxkern import launcher  # noqa: E402




def print_profile(fn, calls: int, top: int = 18) -> None:
    """cProfile's functions by own time over ``calls`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    ops = seven_cases.register_all()
    op = ops["sigmoid"]
    entry = fxkern.kernel_op(f"{seven_cases.NS}::sigmoid")
    x = torch.randn(1024, device="cuda")
    op(x)
    impl = entry.cuda_impl
    kernel = impl.functions.load(0)[impl.lowered(torch.float32)]
    y = torch.empty_like(x)
    stream = launcher.current_stream_handle(0)
    values = [x.data_ptr(), x.numel(), y.data_ptr()]
    rows = {
        "ctypes launch only": lambda: impl.launch(kernel, (4, 1, 1), (256, 1, 1), 0, stream, values, "bench"),
        "torch.sigmoid(x)": lambda: torch.sigmoid(x),
        "torch.ops sigmoid(x)": lambda: op(x),
        "op.default(x)": lambda: op.default(x),
        "CUDA impl called directly": lambda: entry.cuda_impl(x),
        "torch.empty(1024, cuda)": lambda: torch.empty(1024, device=x.device),
        "current_stream_handle": lambda: launcher.current_stream_handle(0),
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
        "x.data_ptr()": lambda: x.data_ptr(),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {host_us(fn):7.2f} us")
    print_profile(lambda: op(x), 20000)


def library() -> None:
    """Host us a call of each library op the demo runs (small inputs, so the GPU never pushes back)
    against its pattern run by eager PyTorch, then the profile of the rotary embedding's calls."""
    import fxkern.library as lib
    from fxkern.library import gelu, rmsnorm, rotary, softmax, swiglu
    from fxkern.library._rules import NAMESPACE

    lib.rules()
    bf = torch.bfloat16

    def t(*shape):
        return torch.randn(*shape, device="cuda").to(bf)

    x, w, r = t(4, 256), t(256), t(4, 256)
    q = t(1, 8, 4 * 64).view(1, 8, 4, 64).transpose(1, 2)
    cos, sin = t(1, 1, 8, 64), t(1, 1, 8, 64)
    scores, mask = t(1, 4, 8, 8), t(1, 1, 8, 8)
    calls = {
        "rms_norm": ((x, w, 1e-6), rmsnorm.llama_rmsnorm),
        "add_rms_norm": ((x, r, w, 1e-6), rmsnorm.add_llama_rmsnorm),
        "swiglu": ((x, r), swiglu.swiglu),
        "bias_gelu_tanh_residual": ((x, w, r), gelu.bias_gelu_tanh_residual),
        "scaled_masked_softmax": ((scores, mask, 0.125), softmax.scaled_masked_softmax_float32),
        "rotary_embedding": ((q, cos, sin, 32), rotary.rotary_embedding),
    }
    # "its eager_fn alone": without the wrapper that runs the reference on calls past the kernels'
    # limits (past_limits="reference"), measured in the same rounds as the wrapped impl
    print(f"{'op':28s} {'fxkern us':>10s} {'its CUDA impl, no dispatcher':>29s} {'its eager_fn alone':>19s} "
          f"{'eager pattern us':>17s}")
    for name, (args, pattern) in calls.items():
        entry = fxkern.kernel_op(f"{NAMESPACE}::{name}")
        op, impl, bare = lib.op(name).default, entry.cuda_impl, entry.eager_fn
        ours, eager = host_us(lambda: op(*args), rounds=50), host_us(lambda: pattern(*args), rounds=50)
        wrapped, unwrapped = [], []
        for _ in range(3):  # alternated, so host noise falls on both alike
            wrapped.append(host_us(lambda: impl(*args), rounds=20))
            if bare is not None:
                unwrapped.append(host_us(lambda: bare(*args), rounds=20))
        wrapped, unwrapped = min(wrapped), min(unwrapped, default=float("nan"))
        print(f"{name:28s} {ours:10.2f} {wrapped:29.2f} {unwrapped:19.2f} {eager:17.2f}")
    op = lib.op("rotary_embedding").default
    print_profile(lambda: op(q, cos, sin, 32), 20000)


def node_host_us(gm: torch.fx.GraphModule, args: tuple, forwards: int = 200) -> tuple[dict[str, tuple[float, float]], float]:
    """Host us per forward of each call target in ``gm``'s graph (calls a forward, us a call), and the
    forward's own us outside its nodes (module call, hooks, pytree, attribute reads): each node's call
    wrapped in a timer, whose own cost outside the timed span is measured and taken off."""
    import collections
    import copy

    spent, calls = collections.defaultdict(float), collections.Counter()

    def timer(f, key):
        def wrap(*a, **kw):
            t0 = time.perf_counter()
            out = f(*a, **kw)
            spent[key] += time.perf_counter() - t0
            calls[key] += 1
            return out
        return wrap

    timed = copy.deepcopy(gm)
    for n in timed.graph.nodes:
        if n.op == "call_function":
            n.target = timer(n.target, str(n.target))
    timed.recompile()
    probe, bare = timer(lambda: None, "probe"), lambda: None
    cost = (host_us(probe, rounds=50) - host_us(bare, rounds=50)) - spent["probe"] / calls["probe"] * 1e6
    for _ in range(3):
        timed(*args)
    torch.cuda.synchronize()
    spent.clear(), calls.clear()
    t0 = time.perf_counter()
    for _ in range(forwards):
        timed(*args)
    total = (time.perf_counter() - t0) / forwards * 1e6
    torch.cuda.synchronize()
    table = {k: (calls[k] / forwards, spent[k] / calls[k] * 1e6) for k in spent}
    return table, total - sum(c * (us + cost) for c, us in table.values())


def model() -> None:
    """The host time of one forward of the demo model (hidden 2048, 4 layers, one sequence of 16 tokens:
    kernels short enough that the host never waits) by variant, then where the exported and the
    rewritten forwards spend it, by call target."""
    import dataclasses

    import fxkern.library as lib
    from fxkern import demo

    cfg = dataclasses.replace(demo.SIZES["base"], batch=1, seq=16)
    m = demo.build_model(cfg, torch.device("cuda"), torch.bfloat16)
    ids = torch.randint(0, cfg.vocab, (1, 16), device="cuda")
    ep = torch.export.export(m, (ids,))
    plain, rewritten = ep.module(), fxkern.apply(ep, lib.rules()).module()
    with torch.no_grad():
        for name, fn in (("eager", m), ("exported, not rewritten", plain), ("rewritten", rewritten),
                         ("rewritten, graph code only", rewritten.forward)):
            print(f"{name:28s} {host_us(lambda fn=fn: fn(ids), burst=5, rounds=40) / 1e3:7.2f} ms")
        tables = {}
        for name, gm in (("exported", plain), ("rewritten", rewritten)):
            tables[name], outside = node_host_us(gm, (ids,))
            print(f"{name}: {outside:7.1f} us a forward outside its nodes")
        keys = sorted(set().union(*tables.values()), key=lambda k: -max(c * us for t in tables.values()
                                                                         for c, us in [t.get(k, (0, 0))]))
        print(f"{'target':48s} {'exported':>22s} {'rewritten':>22s}   (calls a forward x us = us)")
        for k in keys:
            cells = []
            for t in tables.values():
                c, us = t.get(k, (0, 0.0))
                cells.append(f"{c:4.0f} x {us:5.1f} = {c * us:6.0f}" if c else "")
            print(f"{k[:48]:48s} {cells[0]:>22s} {cells[1]:>22s}")
        for name, t in tables.items():
            print(f"{name}: nodes {sum(c * us for c, us in t.values()):7.0f} us a forward")
        print_profile(lambda: rewritten(ids), 200, top=25)


if __name__ == "__main__":
    if "--library" in sys.argv[1:]:
        library()
    elif "--model" in sys.argv[1:]:
        model()
    else:
        main()
