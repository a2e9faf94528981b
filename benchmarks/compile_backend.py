"""torch.compile with fxkern.backend vs plain inductor on a tiny transformers Llama (issue: backend).

Compile time of each (cold process caches aside: both in one process, fxkern second), the share
of fxkern's pass in it, outputs compared, and time per forward (CUDA events, warm-up, median).

    python benchmarks/compile_backend.py [--section-out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
import fxkern  # noqa: E402
from fxkern.backends import torch_compile  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--section-out", type=Path, default=None)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args(argv)
    import llama_rmsnorm
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to("cuda").eval()
    rules = fxkern.RuleSet("bench")
    fxkern.replace(llama_rmsnorm.llama_rmsnorm, llama_rmsnorm.RMSNORM, name="bench::llama_rmsnorm", rules=rules)
    ids = torch.randint(0, 4096, (args.batch, args.seq), device="cuda")

    pass_time = [0.0]
    original = torch_compile.FxkernBackend._rewrite

    def timed(self, graph, irs):
        t0 = time.perf_counter()
        original(self, graph, irs)
        pass_time[0] += time.perf_counter() - t0

    torch_compile.FxkernBackend._rewrite = timed
    results = {}
    with torch.no_grad():
        for name, backend in (("inductor", "inductor"), ("fxkern + inductor", fxkern.backend(rules))):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            t0 = time.perf_counter()
            out = compiled(ids, use_cache=False).logits
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ms = common.cuda_time_ms(lambda: compiled(ids, use_cache=False), inner=1)
            results[name] = (compile_s, ms, out)
        eager_ms = common.cuda_time_ms(lambda: model(ids, use_cache=False), inner=1)
        want = model(ids, use_cache=False).logits
    matches = sum(len(r.matches) for r in backend.reports)
    err = {k: float((v[2] - want).norm() / want.norm()) for k, v in results.items()}
    lines = [
        "## torch.compile backend",
        "",
        f"Machine: {common.machine()}. Date: {common.today()}. Command: `python benchmarks/compile_backend.py`.",
        f"Model: transformers Llama from a config (hidden 1024, 4 layers, vocab 4096), batch {args.batch} x "
        f"{args.seq} tokens, float32, inference. Rule: Llama RMSNorm -> the example row kernel "
        f"({matches} replacements).",
        "",
        "| backend | first call (compile) s | fxkern pass s | ms per forward | logits rel. err vs eager |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| eager | - | - | {eager_ms:.3f} | 0 |",
    ]
    for name, (cs, ms, _) in results.items():
        share = f"{pass_time[0]:.3f} ({pass_time[0] / cs:.1%} of compile)" if name.startswith("fxkern") else "-"
        lines.append(f"| {name} | {cs:.2f} | {share} | {ms:.3f} | {err[name]:.1e} |")
    body = "\n".join(lines)
    common.emit("compile_backend", body, args.section_out)


if __name__ == "__main__":
    main()
