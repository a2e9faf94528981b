"""One scaled, masked softmax call by fxkern, one plain softmax on the same scores and one masked call
by inductor, for Nsight Compute to compare (the masked kernel's tuning, docs/library.md):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python tools/ncu_softmax.py [--dtype bfloat16] [--shape 8x32x512]

--shape is batch x heads x sequence: scores (b, h, s, s) and transformers' (b, 1, s, s) causal mask.
--softcap adds fxkern's soft-capped masked softmax (Gemma 2's, cap 50) on the same scores, after the others.
--variant TEXT adds, last, the variant of benchmarks/masked_tuning.py whose label contains TEXT.
"""

import argparse
import sys
from pathlib import Path

import torch

import fxkern.library as lib
from fxkern.library import softmax

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--shape", default="8x32x512")
parser.add_argument("--softcap", action="store_true")
parser.add_argument("--variant", default=None, metavar="TEXT")
args = parser.parse_args()
b, h, s = (int(v) for v in args.shape.split("x"))
dtype = getattr(torch, args.dtype)
x = (torch.randn(b, h, s, s, device="cuda") * 3).to(dtype)
mask = torch.full((s, s), torch.finfo(dtype).min, device="cuda", dtype=dtype).triu(1).expand(b, 1, s, s).contiguous()
pattern = softmax.scaled_masked_softmax_float32
compiled = torch.compile(pattern, dynamic=False)
lib.rules()  # registers every library op, private ones included
masked, plain, capped = lib.op("scaled_masked_softmax"), lib.op("softmax"), lib.op("softcapped_masked_softmax")
variant = None
if args.variant:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import masked_tuning

    index, label = next((i, label) for i, label in enumerate(masked_tuning.VARIANTS) if args.variant in label)
    variant, _ = masked_tuning.make_op(label, masked_tuning.VARIANTS[label], index, softmax.SCALED_MASKED_SOFTMAX,
                                       "masked")
    print(f"variant: {label}", flush=True)
for _ in range(3):  # compiled, autotuned and warm before the profiled calls
    masked(x, mask, 0.125)
    plain(x)
    compiled(x, mask, 0.125)
    if args.softcap:
        capped(x, mask, 0.125, 50.0)
    if variant:
        variant(x, mask, 0.125)
torch.cuda.synchronize()
torch.cuda.profiler.start()
masked(x, mask, 0.125)
plain(x)
compiled(x, mask, 0.125)
if args.softcap:
    capped(x, mask, 0.125, 50.0)
if variant:
    variant(x, mask, 0.125)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
