"""What a plain copy reaches at the layouts the rotary rows read and write, the roofline of those rows.

    python benchmarks/layout_copy.py [--rounds 3] [--section-out FILE]

The library table holds every kernel to 90% of one device-to-device copy of contiguous memory. The
rotary rows read queries where the projection left them and write what eager PyTorch writes: GPT-NeoX's
partial rotary reads a column block of the fused QKV projection (a third of each row) and writes a
contiguous ``(B, H, S, D)`` tensor, 32 heads' rows apart from each position's read. Here the same
bytes are copied, no arithmetic: by eager PyTorch (``.contiguous()``), by inductor (the same function
compiled) and by the library's ``repeat_kv`` op with ``n_rep = 1`` (its rotary kernel with no rotated
columns, the walk and stores of the rotary rows), beside the rotary op on that layout. GB/s of
useful bytes (read once, written once), CUDA events around 10 back-to-back calls, the GPU kept busy
by an untimed call before each sample, median of 20, then the median over rounds (order rotated).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import torch  # noqa: E402

B, S, H, D = 16, 2048, 32, 128


def layouts(dtype):
    """(name, x as (B, H, S, D), its rotary call or None): contiguous, the projection's view, and the
    query block of a fused QKV projection."""
    flat = torch.randn(B, S, H * D, device="cuda").to(dtype)
    fused = torch.randn(B, S, H * 3 * D, device="cuda").to(dtype).view(B, S, H, 3 * D).transpose(1, 2)
    pos = torch.arange(S, device="cuda", dtype=torch.float32)[:, None]
    emb = pos * (1.0 / 10000 ** (torch.arange(0, 32, 2, device="cuda") / 32))[None]
    emb = torch.cat((emb, emb), -1)[None, None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return [("contiguous (B, H, S, D)", flat.view(B, H, S, D), None),
            ("projected: (B, S, H, D) memory", flat.view(B, S, H, D).transpose(1, 2), None),
            ("fused QKV's query block (GPT-NeoX)", fused[..., :D], ("partial", (cos, sin, 16, 32)))]


def main(argv=None) -> None:
    args = common.tuning_args("layout_copy", "Copies at the rotary layouts", __doc__, argv)
    if args is None:
        return
    import fxkern.library as lib
    from fxkern.library import rotary

    lib.rules()
    repeat, partial = lib.op("repeat_kv"), lib.op("partial_rotary_embedding")
    contiguous = common.inductor(lambda x: x.contiguous())
    partial_inductor = common.inductor(rotary.partial_rotary_embedding)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, x, rope in layouts(dtype):
            nbytes = 2 * x.numel() * x.element_size()
            runs = {"eager .contiguous()": lambda x=x: x.contiguous() if not x.is_contiguous() else x.clone(),
                    "inductor .contiguous()": lambda x=x: contiguous(x) if not x.is_contiguous() else x.clone(),
                    "fxkern repeat_kv, n_rep 1": lambda x=x: repeat(x, B, H, 1, S, D, H)}
            torch.testing.assert_close(runs["fxkern repeat_kv, n_rep 1"](), x.contiguous(), rtol=0, atol=0)
            if rope:
                cos, sin, half, rot = rope[1]
                runs["fxkern partial rotary"] = lambda x=x: partial(x, cos, sin, half, rot)
                runs["inductor partial rotary"] = lambda x=x: partial_inductor(x, cos, sin, half, rot)
                torch.testing.assert_close(runs["fxkern partial rotary"](), rotary.partial_rotary_embedding(
                    x, cos, sin, half, rot), rtol=0, atol=0)
            samples = common.rotated_rounds(runs, args.rounds)
            gbs = {k: nbytes / (sorted(v)[len(v) // 2] * 1e6) for k, v in samples.items()}
            rows.append((name, str(dtype).removeprefix("torch."), gbs))
            print(name, dtype, {k: round(v) for k, v in gbs.items()}, flush=True)
    copy = common.cuda_time_ms  # the library table's copy: contiguous bytes, read once and written once
    x = torch.empty(16384, 8192, device="cuda")
    y = torch.empty_like(x)
    copy_gbs = 2 * x.numel() * 4 / (copy(lambda: y.copy_(x)) * 1e6)
    cols = ["eager .contiguous()", "inductor .contiguous()", "fxkern repeat_kv, n_rep 1", "fxkern partial rotary",
            "inductor partial rotary"]
    lines = [f"| x (B, H, S, D) = {B}x{H}x{S}x{D}, read as | dtype | " + " | ".join(cols) + " |",
             "| --- | --- |" + " ---: |" * len(cols)]
    for name, dt, gbs in rows:
        lines.append(f"| {name} | {dt} | " + " | ".join(f"{gbs[c]:.0f} ({gbs[c] / copy_gbs:.0%})" if c in gbs else "—"
                                                      for c in cols) + " |")
    body = (f"## Copies at the rotary layouts (`benchmarks/layout_copy.py`)\n\nMachine: {common.machine()}. "
            f"Date: {common.today()}. Command: `{common.command('layout_copy.py', args)}`.\n\n"
            f"{' '.join(__doc__.split(chr(10) + chr(10))[2].split())}\n\n"
            f"GB/s (and share of the device-to-device copy of contiguous memory, {copy_gbs:.0f} GB/s in this run):\n\n"
            + "\n".join(lines) + "\n")
    common.emit("layout_copy", body, args.section_out)


if __name__ == "__main__":
    main()
