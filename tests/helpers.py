"""Test helpers: a KernelSpec shaped like a pattern, for rules tested on the CPU (the reference runs)."""

import itertools

import torch

from fxkern import Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput
from fxkern.patterns import pattern_params

_ids = itertools.count()
CTYPES = {float: "float", int: "int", bool: "bool"}


def spec_like(pattern, n_out=1, dtypes=None, same_as=None):
    """A spec whose inputs mirror ``pattern``'s parameters (tensors may broadcast to the first)."""
    params = pattern_params(pattern)
    first = same_as or next(p.name for p in params if p.kind == "tensor")
    name = f"k{next(_ids)}"
    elem = "T" if dtypes else "float"
    args = []
    inputs = []
    for p in params:
        if p.kind == "tensor":
            args.append(f"const {elem}* {p.name}")
            inputs.append(InputDecl(p.name, broadcast=p.name != first))
        else:
            args.append(f"{CTYPES[p.py_type]} {p.name}")
            inputs.append(ScalarInput(p.name, p.py_type))
    args.append("int n")
    args += [f"{elem}* out{j}" for j in range(n_out)]
    head = "template <typename T>\n__global__" if dtypes else 'extern "C" __global__'
    src = f"{head} void {name}({', '.join(args)}) {{}}\n"
    return KernelSpec(
        src, name, inputs=inputs,
        outputs=[OutputDecl(f"out{j}", SameAs(first)) for j in range(n_out)],
        extras=[Numel(first)], geometry=Elementwise(), dtypes=dtypes,
    )


def count_target(program, op):
    gm = program.graph_module if hasattr(program, "graph_module") else program
    target = op.default if hasattr(op, "default") else op
    return sum(1 for n in gm.graph.nodes if n.target == target)


def export(module, *args, **kw):
    return torch.export.export(module, args, **kw)


class Fn(torch.nn.Module):
    """A module whose forward is a plain function (what the tests export)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def library_ops():
    """Every op of fxkern.library, by name (registers the library: NVRTC, no GPU needed)."""
    import fxkern.library

    ops = {}
    for r in fxkern.library.rules():
        ops.setdefault(str(r.op.default._schema.name), r.op)
    return ops


def library_inputs(op, dtype, device, rows=37, cols=1000):
    """Inputs for a library op: (rows, cols) tensors, (cols,) for inputs the kernel broadcasts, small
    scalars; attention's masked softmax gets (2, 3, rows, cols) scores, a (2, 1, rows, cols) mask and
    a scale (or divisor) of 8, and Gemma 2's a cap of 0.1 (randn scores times 1/8, over 0.1, reach
    tanh's curve); the rotary embedding (2, 3, rows, d) queries with d the even one of cols and
    cols - 1, (2, 1, rows, d) cos and sin (float32 for OLMo's op) and half = d // 2 (the partial one rotating half of d,
    rounded to even; the interleaved ones the same without half; DeepSeek-V3's and GPT-OSS's with
    (2, 1, rows, d // 2) tables); GPT-OSS's sink softmax the masked scores with (3,) sinks and the expand's sizes (2, rows),
    and its expert gate (rows, d) interleaved columns with its alpha and limits (1.702, 7);
    repeat_kv's (2, 3, rows, d) keys repeated twice, with their sizes; a head's norm
    and rotation the same with heads of d = 256 (74 for odd cols) and a (d,) weight."""
    from fxkern import kernel_op

    name = str(op.default._schema.name)
    plan = kernel_op(name).plan
    d = cols - cols % 2
    sizes = (2, 3, 2, rows, d, 6)  # batch, kv_heads, n_rep, seq, head_dim, heads
    if "rms_norm_rotary" in name:  # heads of at most 256: 74 (the scalar path) for odd cols, else 256
        d = 74 if cols % 2 else min(d, 256)
        gemma = name.startswith("fxkern_lib::gemma")  # x as the norm reads it: (b, h, s, d), else (b, s, h, d)
        x = torch.randn((2, 3, rows, d) if gemma else (2, rows, 3, d), dtype=dtype, device=device)
        # a weight near the models' (Llama's near 1, Gemma's offsets from 1 near 0) and tables of cosines
        # and sines: eager's roundings of the products, which the kernel keeps, stay within the tolerances
        weight = (0.1 * torch.randn(d) + (0.0 if gemma else 1.0)).to(dtype=dtype, device=device)
        angles = torch.randn(2, 1, rows, d)
        cos, sin = (t.to(dtype=dtype, device=device) for t in (angles.cos(), angles.sin()))
        return (x, weight, cos, sin, 1e-5, d // 2) + ((2, 3, 2, rows, d, 6) if "repeat_kv" in name else ())
    if "deinterleaved_rotary" in name or "chunked_rotary" in name:  # DeepSeek-V3's, GPT-OSS's: half-wide tables
        x = torch.randn(2, 3, rows, d, dtype=dtype, device=device)
        return (x, *(torch.randn(2, 1, rows, d // 2, dtype=dtype, device=device) for _ in range(2)))
    if "interleaved_rotary" in name:  # pairs (2i, 2i + 1) rotated; the partial op rotates half of d, rounded to even
        rot = d // 4 * 2 if "partial" in name else d
        x = torch.randn(2, 3, rows, d, dtype=dtype, device=device)
        tables = torch.float32 if "float32_tables" in name else dtype  # ERNIE's op: float32 cos and sin
        cos, sin = (torch.randn(2, 1, rows, rot, dtype=tables, device=device) for _ in range(2))
        return (x, cos, sin) + ((rot,) if "partial" in name else ())
    if "partial_rotary" in name:  # the first rot columns of each row rotated, the rest copied
        rot = d // 4 * 2
        x = torch.randn(2, 3, rows, d, dtype=dtype, device=device)
        cos, sin = (torch.randn(2, 1, rows, rot, dtype=dtype, device=device) for _ in range(2))
        return (x, cos, sin, rot // 2, rot) + (sizes if "repeat_kv" in name else ())
    if "rotary" in name:  # OLMo's op: float32 cos and sin
        x, cos, sin = (torch.randn(2, n, rows, d, dtype=torch.float32 if n == 1 and "float32_tables" in name else dtype,
                                   device=device) for n in (3, 1, 1))
        return (x, cos, sin, d // 2) + (sizes if "repeat_kv" in name else ())
    if "repeat_kv" in name:
        return (torch.randn(2, 3, rows, d, dtype=dtype, device=device),) + sizes
    if "sink_masked_softmax" in name:  # GPT-OSS's: the masked scores, one sink a head, the expand's sizes
        x, mask = (torch.randn(2, h, rows, cols, dtype=dtype, device=device) for h in (3, 1))
        return (x, mask, torch.randn(3, dtype=dtype, device=device), 1 / 8, 2, rows)
    if "clamped_swiglu" in name:  # GPT-OSS's gate: rows of d interleaved (gate, up) columns, its alpha and limits
        return (4 * torch.randn(rows, d, dtype=dtype, device=device), 1.702, 7.0, -7.0, 7.0)
    if "chunked" in name:  # the chunked GLUs split x's rows in two halves of cols each
        cols *= 2
    shapes = {"x": (2, 3, rows, cols), "mask": (2, 1, rows, cols)} if "masked_softmax" in name else {}
    args = []
    for d in plan.inputs:
        if isinstance(d, InputDecl):
            shape = (cols,) if d.broadcast and ("weight" in d.name or "bias" in d.name) else (rows, cols)
            args.append(torch.randn(shapes.get(d.name, shape), dtype=d.dtype or dtype, device=device))
        elif d.name in ("scale", "divisor", "cap"):
            args.append({"scale": 1 / 8, "divisor": 8.0, "cap": 0.1}[d.name])
        elif d.name == "normalized_size":  # F.rms_norm's [D]: the row length
            args.append(cols)
        else:
            args.append({float: 1e-5, int: 3, bool: True}[d.py_type])
    return tuple(args)


def example_cases():
    """pytest params (case, dtype) for every seven-case example in each dtype it is built for."""
    import pytest
    import seven_cases

    return [pytest.param(case, dtype, id=f"{case.name}-{str(dtype)[6:]}")
            for case in seven_cases.CASES for dtype in case.dtypes]
