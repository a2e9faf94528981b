"""Library calls past 2^31 elements: cut into pieces (``past_limits="split"``) against eager and inductor.

    python benchmarks/past_int32.py [--rounds 3] [--section-out FILE]

A rewritten model meets sizes past what a 32-bit index reaches where the original ran them: eager
attention's scores at batch 1, 32 heads and 8192 keys (Llama-style models with eager attention, Gemma 2
27B at its full context) hold 2^31 elements. Such a call used to run the op's reference, the model's
own code at eager speed; an op that promises its rows are independent (``fxkern.split``) now runs as
launches of at most 2^30 elements each, every launch writing its part of one output.

bfloat16. Each row times the op on the call past the limit, the same pattern in eager PyTorch (what
the op ran there before) and under inductor (``torch.compile``, default mode, static shapes), and the
op on one piece of the call. GB/s of useful bytes (each input read once, the output written once),
CUDA events around 3 back-to-back calls, the GPU kept busy by an untimed call before each sample,
median of 10, then the median over rounds (the order rotated each round); "one piece" is the op on the first piece of the call alone (the kernel's own speed, within the
limit); "copy" is a device-to-device copy of 2^31 elements, and "of copy" the op's share of it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

DTYPE = torch.bfloat16
TIMER = dict(warmup=2, reps=10, inner=3)


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32) * scale).to(DTYPE)


def causal_mask(tokens):
    return torch.full((tokens, tokens), torch.finfo(DTYPE).min, device="cuda", dtype=DTYPE).triu(1)[None, None]


def cases():
    """(label, op name, pattern, the call's arguments): each made when its row runs, so one case's
    gigabytes are freed before the next."""
    from fxkern.library import rmsnorm, softmax, swiglu

    def scores(batch=1):
        return rand(batch, 32, 8192, 8192, scale=4.0), causal_mask(8192).expand(batch, 1, 8192, 8192).contiguous()

    yield ("Llama eager attention's scaled, masked softmax, 1x32x8192x8192", "scaled_masked_softmax",
           softmax.scaled_masked_softmax, lambda: (*scores(), 0.125))
    yield ("Gemma 2's soft-capped, masked softmax, 1x32x8192x8192", "softcapped_masked_softmax",
           softmax.softcapped_masked_softmax, lambda: (*scores(), 0.0625, 50.0))
    yield ("Gemma 2's soft-capped, masked softmax, 2x32x8192x8192 (four pieces)", "softcapped_masked_softmax",
           softmax.softcapped_masked_softmax, lambda: (*scores(2), 0.0625, 50.0))
    yield ("Llama's RMSNorm, 262144x8192", "rms_norm", rmsnorm.llama_rmsnorm,
           lambda: (rand(1 << 18, 8192), rand(8192), 1e-6))
    yield ("SwiGLU, 262144x8192", "swiglu", swiglu.swiglu, lambda: (rand(1 << 18, 8192), rand(1 << 18, 8192)))


def first_piece(call, out):
    """The arguments of the first piece ``fxkern.split`` cuts ``call`` into (views of them)."""
    from fxkern import split

    cut = split.plan([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in call], [tuple(out.shape)])
    at, start, length = cut.pieces[0]
    return tuple(split._narrow(a, out.dim(), cut.axis, at, start, length) for a in call)


def useful_bytes(args, out):
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)) + out.numel() * out.element_size()


def main(argv=None) -> None:
    args = common.tuning_args("past_int32", "Calls past 2^31 elements", __doc__, argv)
    if args is None:
        return
    import fxkern.library as lib

    lib.rules()
    x = torch.empty(2**31, device="cuda", dtype=DTYPE)
    copy_ms = statistics.median(common.rotated_rounds({"copy": lambda x=x: x.clone()}, args.rounds, **TIMER)["copy"])
    copy = 2 * x.numel() * x.element_size() / (copy_ms * 1e-3) / 1e9
    del x
    rows = []
    for label, name, pattern, make in cases():
        op = lib.op(name)
        call = make()
        got, want = op(*call), pattern(*call)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        nbytes = useful_bytes(call, got)
        del got, want
        compiled = common.inductor(pattern)
        samples = common.rotated_rounds({"fxkern": lambda call=call: op(*call),
                                         "eager": lambda call=call: pattern(*call),
                                         "inductor": lambda call=call: compiled(*call)}, args.rounds, **TIMER)
        gbs = {k: nbytes / (statistics.median(v) * 1e-3) / 1e9 for k, v in samples.items()}
        piece = first_piece(call, op(*call))
        piece_bytes = useful_bytes(piece, op(*piece))
        piece_ms = statistics.median(common.rotated_rounds({"piece": lambda piece=piece: op(*piece)}, args.rounds,
                                                           **TIMER)["piece"])
        gbs["piece"] = piece_bytes / (piece_ms * 1e-3) / 1e9
        del call, piece
        torch.cuda.empty_cache()
        rows.append((label, gbs, err))
        print(label, {k: round(v) for k, v in gbs.items()}, f"rel. err {err:.1e}", flush=True)
    lines = [
        "## Library calls past 2^31 elements (`fxkern.split`)",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/past_int32.py "
        f"--rounds {args.rounds}`.",
        "",
        " ".join(__doc__.split("\n\n")[2].split()),
        "",
        " ".join(__doc__.split("\n\n")[3].split()),
        "",
        f"Copy: {copy:.0f} GB/s.",
        "",
        "| call (bfloat16) | fxkern, cut | eager | inductor | fxkern, one piece | of copy | vs eager | vs inductor | rel. err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, g, err in rows:
        lines.append(f"| {label} | {g['fxkern']:.0f} | {g['eager']:.0f} | {g['inductor']:.0f} | {g['piece']:.0f} | "
                     f"{g['fxkern'] / copy:.0%} | {g['fxkern'] / g['eager']:.2f}x | {g['fxkern'] / g['inductor']:.2f}x | "
                     f"{err:.1e} |")
    common.emit("past_int32", "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
