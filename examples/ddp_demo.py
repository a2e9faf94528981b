"""The demo model rewritten with fxkern's library, data parallel over the GPUs of one host.

    FXKERN_CACHE_DIR=$(mktemp -d) torchrun --nproc_per_node 2 examples/ddp_demo.py [--size small]

One process per GPU, each on its own device (``LOCAL_RANK``), each with the
same weights and its own shard of the batch: export, apply
``fxkern.library.rules()``, run, compare with the original model on that
shard. Rank 0 prints one line per rank and how many kernels the processes
compiled between them: with a cold shared cache, each kernel is compiled
once for all processes (the others wait on its lock and read the cache).
Exit status 0 only if every rank is correct and that count holds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)

    import fxkern
    import fxkern.library
    from fxkern import compiler
    from fxkern.demo import DTYPES, SIZES, TOLERANCE, build_model

    cold = not any(compiler.cache_dir().glob("*.json"))
    dist.barrier()  # every rank has looked at the cache before any writes to it
    rules = fxkern.library.rules()  # registration compiles each kernel, through the shared cache
    dist.barrier()
    kernels = len(list(compiler.cache_dir().glob("*.json")))  # distinct compiled sources
    cfg, dtype = SIZES[args.size], DTYPES[args.dtype]
    model = build_model(cfg, device, dtype, seed=0)  # the same weights on every rank
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (cfg.batch * world, cfg.seq), generator=gen)[rank::world].to(device)

    ep = torch.export.export(model, (ids,))
    new = fxkern.apply(ep, rules)
    n_ops = sum(1 for n in new.graph.nodes if n.op == "call_function" and str(n.target).startswith("fxkern_lib."))
    with torch.no_grad():
        want, got = model(ids), new.module()(ids)
    err = float((got.float() - want.float()).norm() / want.float().norm())
    ok = err < TOLERANCE[dtype] and n_ops > 0 and got.device == device

    stats = torch.tensor([float(ok), err, n_ops, compiler.stats["compiles"], compiler.stats["hits"]], device=device)
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    status = 0
    if rank == 0:
        total = 0
        for r, s in enumerate(gathered):
            good, e, n, c, h = s.tolist()
            total += int(c)
            print(f"rank {r} (cuda:{r if world > 1 else local}): {'ok' if good else 'WRONG'}  "
                  f"{int(n)} fxkern ops  logits rel. err {e:.2e}  compiled {int(c)}, cache hits {int(h)}")
        once = total == kernels if cold else total == 0
        print(f"{world} processes compiled {total} kernels ({kernels} distinct in the "
              f"{'cold' if cold else 'warm'} cache): {'each once' if once else 'NOT once each'}")
        status = 0 if all(s[0].item() == 1.0 for s in gathered) and once else 1
    flag = torch.tensor([status], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
