"""One RMSNorm call by fxkern and one by inductor, for Nsight Compute to compare (the row kernels'
tuning, docs/library.md):

    ncu --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python tools/ncu_rows.py [--dtype bfloat16] [--shape 16384x8192] [--add] [--op NAME]

--op profiles another op of the library's namespace instead of the public one, e.g. a two-read
kernel's private op on a dtype it is not tuned for (``_rms_norm_two_read_32bit``).
"""

import argparse

import torch

import fxkern.library as lib
from fxkern.library import rmsnorm

parser = argparse.ArgumentParser()
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--shape", default="16384x8192")
parser.add_argument("--add", action="store_true", help="residual add + RMSNorm")
parser.add_argument("--op", default=None, help="an op of fxkern_lib to profile in place of the public one")
args = parser.parse_args()
if args.op and args.add:
    parser.error("--op takes a plain norm's private op (x, weight, eps); leave out --add")
rows, d = (int(v) for v in args.shape.split("x"))
dtype = getattr(torch, args.dtype)
x, r, w = (torch.randn(rows, d, device="cuda", dtype=dtype), torch.randn(rows, d, device="cuda", dtype=dtype),
           torch.randn(d, device="cuda", dtype=dtype))
pattern, name, call = ((rmsnorm.add_llama_rmsnorm, "add_rms_norm", (x, r, w, 1e-6)) if args.add
                       else (rmsnorm.llama_rmsnorm, "rms_norm", (x, w, 1e-6)))
compiled = torch.compile(pattern, dynamic=False)
lib.rules()  # registers every library op, private ones included
op = getattr(torch.ops.fxkern_lib, args.op) if args.op else lib.op(name)
for _ in range(3):  # compiled, autotuned and warm before the profiled calls
    op(*call)
    compiled(*call)
torch.cuda.synchronize()
torch.cuda.profiler.start()
op(*call)
compiled(*call)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
