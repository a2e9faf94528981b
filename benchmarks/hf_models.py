"""fxkern.library on models nobody here wrote: transformers' own decoder models, built from configs.

    python benchmarks/hf_models.py [--models llama,gemma,...] [--layers 4] [--rounds 3] [--section-out FILE]

Each model (random weights, no downloads) at hidden size 2048, 16 heads of 128, MLP 5632 (GPT-2
and GPT-NeoX: 8192), vocabulary 8192, in bfloat16 with transformers' default attention (SDPA), on
8x512 tokens: exported with ``use_cache=False``, rewritten with ``fxkern.apply(ep,
fxkern.library.rules())``, and timed in one run against the alternatives a user has: the model in
eager, its export run as is, and ``torch.compile(model)`` (inductor, default mode). The eager model
and the rewritten program are also captured in CUDA graphs: their kernels alone, no Python between
them, so "kernels" compares what the GPU does and "eager" adds what the host does. CUDA events
around 10 back-to-back forwards, warm-up, median of 20, then the median of 3 rounds with the order
rotated each round; a one-layer copy of the first model runs first, untimed, to take the process's
one-time costs. "rel. err" is ‖Δlogits‖/‖logits‖ against the eager model on fresh tokens. Writes the
``hf_models`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, machine, rotated_rounds, today  # noqa: E402

import fxkern  # noqa: E402
import fxkern.library  # noqa: E402
from fxkern.demo import compare, cuda_graph  # noqa: E402

HIDDEN, HEADS, MLP, VOCAB, BATCH, SEQ = 2048, 16, 5632, 8192, 8, 512


def configs(layers: int) -> dict[str, tuple[str, dict]]:
    """Model class name and config keyword arguments, by short name."""
    llama_like = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ)
    return {
        "llama": ("LlamaForCausalLM", llama_like),
        "qwen2": ("Qwen2ForCausalLM", llama_like),
        "mistral": ("MistralForCausalLM", llama_like),
        "phi3": ("Phi3ForCausalLM", {**llama_like, "pad_token_id": 0, "eos_token_id": 0}),
        "gemma": ("GemmaForCausalLM", {**llama_like, "head_dim": HIDDEN // HEADS}),
        "gpt2": ("GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=layers, n_head=HEADS,
                                         n_positions=SEQ, bos_token_id=0, eos_token_id=0)),
        "gpt_neox": ("GPTNeoXForCausalLM", dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                                num_hidden_layers=layers, num_attention_heads=HEADS,
                                                max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)),
    }


def build(class_name: str, kwargs: dict, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, class_name)
    config = getattr(transformers, class_name.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config"))(**kwargs)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(config)
    return model.to(dtype).eval()


def measure(name: str, class_name: str, kwargs: dict, dtype: torch.dtype, rules, rounds: int) -> dict:
    model = build(class_name, kwargs, dtype)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    fresh = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    t0 = time.perf_counter()
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    t1 = time.perf_counter()
    new = fxkern.apply(ep, rules)
    t2 = time.perf_counter()
    replaced = Counter(n.target.name().split("::")[1].split(".")[0] for n in new.graph.nodes
                       if getattr(n.target, "namespace", None) == "fxkern_lib")
    original, rewritten = ep.module(), new.module()
    compiled = torch.compile(model)

    def logits(fn, tokens):
        with torch.no_grad():
            return fn(tokens, use_cache=False).logits

    want = logits(model, fresh)
    t3 = time.perf_counter()
    logits(compiled, ids)
    compile_s = time.perf_counter() - t3
    runs = {
        "eager": lambda: logits(model, ids),
        "export": lambda: logits(original, ids),
        "fxkern": lambda: logits(rewritten, ids),
        "inductor": lambda: logits(compiled, ids),
    }
    for label, fn in (("eager", model), ("fxkern", rewritten)):
        try:
            graph = cuda_graph(lambda t, fn=fn: fn(t, use_cache=False).logits, ids)
        except RuntimeError as e:  # a forward that syncs with the host cannot be captured
            print(f"  {label}: no CUDA graph ({str(e).splitlines()[0][:200]})", flush=True)
            continue
        runs[f"{label}, CUDA graph"] = lambda graph=graph: graph(ids)
    times = {label: statistics.median(ms) for label, ms in rotated_rounds(runs, rounds).items()}
    check = compare(logits(rewritten, fresh), want, dtype)
    torch._dynamo.reset()
    return {"name": name, "class": class_name, "replaced": replaced, "times": times, "rel": check.rel, "ok": check.ok,
            "export_s": t1 - t0, "apply_s": t2 - t1, "compile_s": compile_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated short names (default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--section-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import transformers

    table = configs(args.layers)
    names = args.models.split(",") if args.models else list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        p.error(f"unknown models {unknown}; pick from {sorted(table)}")
    rules = fxkern.library.rules()
    # One-time costs (loading the library's kernels, inductor's and dynamo's first compile, cuBLAS's
    # first choices) go to an untimed one-layer copy of the first model, not to its row.
    print(f"warm-up: {names[0]}, one layer…", flush=True)
    measure(names[0], *configs(1)[names[0]], torch.bfloat16, rules, rounds=1)
    rows = []
    for name in names:
        class_name, kwargs = table[name]
        print(f"{name}: {class_name}…", flush=True)
        r = measure(name, class_name, kwargs, torch.bfloat16, rules, args.rounds)
        print(f"  {dict(r['replaced'])} " + ", ".join(f"{k} {v:.3f} ms" for k, v in r["times"].items())
              + f"; rel {r['rel']:.1e}", flush=True)
        rows.append(r)
        torch.cuda.empty_cache()

    lines = [
        "## transformers models with `fxkern.library` (`benchmarks/hf_models.py`)",
        "",
        f"Machine: {machine()}, transformers {transformers.__version__}. Date: {today()}. "
        f"Command: `python benchmarks/hf_models.py --layers {args.layers} --rounds {args.rounds}"
        f"{' --models ' + args.models if args.models else ''}`.",
        "",
        " ".join(__doc__.split("\n\n")[1].split()),
        "",
        "| model | what fxkern replaced | eager ms | export ms | fxkern ms | fxkern vs eager | eager, CUDA graph ms "
        "| fxkern, CUDA graph ms | kernels: fxkern vs eager | inductor ms | inductor vs eager | rel. err "
        "| export + apply s | inductor compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["times"]
        what = ", ".join(f"{k} ×{v}" for k, v in sorted(r["replaced"].items())) or "nothing"
        g0, g1 = t.get("eager, CUDA graph", math.nan), t.get("fxkern, CUDA graph", math.nan)
        lines.append(
            f"| {r['class']} | {what} | {t['eager']:.3f} | {t['export']:.3f} | {t['fxkern']:.3f} "
            f"| {t['eager'] / t['fxkern']:.2f}x | {g0:.3f} | {g1:.3f} | {g0 / g1:.2f}x | {t['inductor']:.3f} "
            f"| {t['eager'] / t['inductor']:.2f}x | {r['rel']:.1e}{'' if r['ok'] else ' (over tolerance)'} "
            f"| {r['export_s']:.1f} + {r['apply_s']:.1f} | {r['compile_s']:.1f} |")
    emit("hf_models", "\n".join(lines), args.section_out)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
