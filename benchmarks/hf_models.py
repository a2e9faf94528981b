"""fxkern.library on models nobody here wrote: transformers' own models, built from configs.

    python benchmarks/hf_models.py [--models llama,gemma,...] [--layers 4] [--rounds 3] [--batch 8 --seq 512] [--section-out FILE]
    python benchmarks/hf_models.py --models t5_encoder --profile   # also each variant's kernels by GPU time, and the aten ops behind the rewritten program's

Each model (random weights, no downloads) at hidden size 2048, 16 heads of 128, MLP 5632 (GPT-2,
GPT-NeoX, OPT and BERT: 8192), vocabulary 8192, in bfloat16 with transformers' default attention (SDPA;
eager for Gemma 2, whose soft-capped scores need it, and for BERT, given a padding mask), on 8x512 tokens: eleven
decoders (exported with ``use_cache=False``) and three encoders (Flan-T5's, BERT's and ModernBERT's), rewritten
with ``fxkern.apply(ep, fxkern.library.rules())``, and timed in one run against the alternatives a user has: the model in
eager, its export run as is, and ``torch.compile(model)`` (inductor, default mode). The eager model
and the rewritten program are also captured in CUDA graphs: their kernels alone, no Python between
them, so "kernels" compares what the GPU does and "eager" adds what the host does. CUDA events
around 10 back-to-back forwards, warm-up, median of 20, then the median of 3 rounds with the order
rotated each round; a one-layer copy of the first model runs first, untimed, to take the process's
one-time costs. "rel. err" is ‖Δ‖/‖ref‖ of the logits (encoders: the last hidden state) against the
eager model on fresh tokens. "—": a forward that copies between host and GPU cannot be captured
in a CUDA graph (Gemma 2's and BERT's eager models do). Writes the ``hf_models`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, kernel_profile, machine, rotated_rounds, today  # noqa: E402

import fxkern  # noqa: E402
import fxkern.library  # noqa: E402
from fxkern.demo import compare, cuda_graph  # noqa: E402

HIDDEN, HEADS, MLP, VOCAB, BATCH, SEQ = 2048, 16, 5632, 8192, 8, 512


@dataclass
class Model:
    """A transformers model to build: its class, its config's class and arguments, and how it is called."""

    cls: str
    config_cls: str
    config: dict
    decoder: bool = True  # called with use_cache=False, read at .logits; else an encoder, at .last_hidden_state
    attention: str | None = None  # the attention implementation, when not transformers' default (SDPA)
    mask: bool = False  # called with an all-ones attention_mask, as a padded batch would be

    def build(self, dtype: torch.dtype, device: str = "cuda") -> torch.nn.Module:
        import transformers

        config = getattr(transformers, self.config_cls)(**self.config)
        if self.attention:
            config._attn_implementation = self.attention
        torch.manual_seed(0)
        with torch.device(device):
            model = getattr(transformers, self.cls)(config)
        return model.to(dtype).eval()

    def kwargs(self, tokens: torch.Tensor) -> dict:
        """The forward's keyword arguments besides the tokens."""
        out = {"use_cache": False} if self.decoder else {}
        if self.mask:
            out["attention_mask"] = torch.ones_like(tokens)
        return out

    def output(self, fn, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            result = fn(tokens, **self.kwargs(tokens))
        return result.logits if self.decoder else result.last_hidden_state


def configs(layers: int, hidden: int = HIDDEN, heads: int = HEADS, mlp: int = MLP, vocab: int = VOCAB,
            seq: int = SEQ) -> dict[str, Model]:
    """The models, by short name (the sizes' defaults are the benchmark's; tests build them small)."""
    llama_like = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=seq)
    return {
        "llama": Model("LlamaForCausalLM", "LlamaConfig", llama_like),
        "qwen2": Model("Qwen2ForCausalLM", "Qwen2Config", llama_like),
        "mistral": Model("MistralForCausalLM", "MistralConfig", llama_like),
        "phi3": Model("Phi3ForCausalLM", "Phi3Config", {**llama_like, "pad_token_id": 0, "eos_token_id": 0}),
        "gemma": Model("GemmaForCausalLM", "GemmaConfig", {**llama_like, "head_dim": hidden // heads}),
        # Gemma 2: norms after attention and the MLP too, and soft-capped scores, which only eager attention
        # computes (asked for by name: transformers' default for Gemma 2 moved between releases)
        "gemma2": Model("Gemma2ForCausalLM", "Gemma2Config", {**llama_like, "head_dim": hidden // heads},
                        attention="eager"),
        # Gemma 3: also RMSNorms of the queries and keys
        "gemma3": Model("Gemma3ForCausalLM", "Gemma3TextConfig", {**llama_like, "head_dim": hidden // heads}),
        # Qwen3: Llama's layout with RMSNorms of the queries and keys, each head's before RoPE
        "qwen3": Model("Qwen3ForCausalLM", "Qwen3Config", {**llama_like, "head_dim": hidden // heads}),
        "gpt2": Model("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=vocab, n_embd=hidden, n_layer=layers,
                                                             n_head=heads, n_positions=seq, bos_token_id=0,
                                                             eos_token_id=0)),
        "gpt_neox": Model("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=seq, bos_token_id=0, eos_token_id=0)),
        # OPT: LayerNorms after its residual adds with a reshape to rows, or a view back, between the two
        # (fxkern.views moves it above the add); a ReLU MLP
        "opt": Model("OPTForCausalLM", "OPTConfig", dict(
            vocab_size=vocab, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
            max_position_embeddings=seq, word_embed_proj_dim=hidden, pad_token_id=1, bos_token_id=2, eos_token_id=2)),
        # encoders: Flan-T5's (gated gelu_new MLP, T5's RMSNorm) and BERT with its eager attention
        # (scaled, masked softmax), given a padding mask
        "t5_encoder": Model("T5EncoderModel", "T5Config", dict(
            vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=mlp, num_layers=layers, num_heads=heads,
            feed_forward_proj="gated-gelu"), decoder=False),
        # ModernBERT: bias-free LayerNorms after its residual adds, and the GELU of one half of its fused MLP
        # projection times the other
        "modernbert": Model("ModernBertModel", "ModernBertConfig", dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=seq, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            cls_token_id=1, sep_token_id=2), decoder=False),
        "bert": Model("BertModel", "BertConfig", dict(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=seq), decoder=False, attention="eager", mask=True),
    }


def measure(name: str, spec: Model, dtype: torch.dtype, rules, rounds: int, profile: bool = False,
            batch: int = BATCH, seq: int = SEQ) -> dict:
    model = spec.build(dtype)
    ids = torch.randint(0, VOCAB, (batch, seq), device="cuda")
    fresh = torch.randint(0, VOCAB, (batch, seq), device="cuda")
    t0 = time.perf_counter()
    ep = torch.export.export(model, (ids,), kwargs=spec.kwargs(ids))
    t1 = time.perf_counter()
    new = fxkern.apply(ep, rules)
    t2 = time.perf_counter()
    replaced = Counter(n.target.name().split("::")[1].split(".")[0] for n in new.graph.nodes
                       if getattr(n.target, "namespace", None) == "fxkern_lib")
    original, rewritten = ep.module(), new.module()
    compiled = torch.compile(model)
    want = spec.output(model, fresh)
    t3 = time.perf_counter()
    spec.output(compiled, ids)
    compile_s = time.perf_counter() - t3
    runs = {
        "eager": lambda: spec.output(model, ids),
        "export": lambda: spec.output(original, ids),
        "fxkern": lambda: spec.output(rewritten, ids),
        "inductor": lambda: spec.output(compiled, ids),
    }
    for label, fn in (("eager", model), ("fxkern", rewritten)):
        try:
            graph = cuda_graph(lambda t, fn=fn: spec.output(fn, t), ids)
        except RuntimeError as e:  # a forward that syncs with the host cannot be captured
            print(f"  {label}: no CUDA graph ({str(e).splitlines()[0][:200]})", flush=True)
            continue
        runs[f"{label}, CUDA graph"] = lambda graph=graph: graph(ids)
    times = {label: statistics.median(ms) for label, ms in rotated_rounds(runs, rounds).items()}
    if profile:
        for label in ("eager", "fxkern", "inductor"):
            kernel_profile(f"{name}, {label}", runs[label], ops=25 if label == "fxkern" else 0)
    check = compare(spec.output(rewritten, fresh), want, dtype)
    torch._dynamo.reset()
    return {"name": name, "class": spec.cls + (f" ({spec.attention} attention)" if spec.attention else ""),
            "replaced": replaced, "times": times, "rel": check.rel, "ok": check.ok,
            "export_s": t1 - t0, "apply_s": t2 - t1, "compile_s": compile_s}


def _ms(value: float | None) -> str:
    """A time for the table; "—" where the forward could not be captured in a CUDA graph."""
    return "—" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated short names (default: all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--seq", type=int, default=SEQ, help="tokens a sequence (attention's scores are seq x seq)")
    p.add_argument("--section-out", type=Path, default=None)
    p.add_argument("--profile", action="store_true",
                   help="print each model's kernels by GPU time (eager, fxkern, inductor), and the aten ops "
                   "left in the rewritten program by the GPU time they launch")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    import transformers

    table = configs(args.layers, seq=max(args.seq, SEQ))
    names = args.models.split(",") if args.models else list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        p.error(f"unknown models {unknown}; pick from {sorted(table)}")
    rules = fxkern.library.rules()
    # One-time costs (loading the library's kernels, inductor's and dynamo's first compile, cuBLAS's
    # first choices) go to an untimed one-layer copy of the first model, not to its row.
    print(f"warm-up: {names[0]}, one layer…", flush=True)
    measure(names[0], configs(1, seq=max(args.seq, SEQ))[names[0]], torch.bfloat16, rules, rounds=1,
            batch=args.batch, seq=args.seq)
    rows = []
    for name in names:
        print(f"{name}: {table[name].cls}…", flush=True)
        r = measure(name, table[name], torch.bfloat16, rules, args.rounds, args.profile, args.batch, args.seq)
        print(f"  {dict(r['replaced'])} " + ", ".join(f"{k} {v:.3f} ms" for k, v in r["times"].items())
              + f"; rel {r['rel']:.1e}", flush=True)
        rows.append(r)
        torch.cuda.empty_cache()

    lines = [
        "## transformers models with `fxkern.library` (`benchmarks/hf_models.py`)",
        "",
        f"Machine: {machine()}, transformers {transformers.__version__}. Date: {today()}. "
        f"Command: `python benchmarks/hf_models.py --layers {args.layers} --rounds {args.rounds}"
        f"{' --models ' + args.models if args.models else ''}"
        f"{f' --batch {args.batch} --seq {args.seq}' if (args.batch, args.seq) != (BATCH, SEQ) else ''}`.",
        "",
        " ".join(__doc__.split("\n\n")[2].replace("on 8x512 tokens", f"on {args.batch}x{args.seq} tokens").split()),
        "",
        "| model | what fxkern replaced | eager ms | export ms | fxkern ms | fxkern vs eager | eager, CUDA graph ms "
        "| fxkern, CUDA graph ms | kernels: fxkern vs eager | inductor ms | inductor vs eager | rel. err "
        "| export + apply s | inductor compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["times"]
        what = ", ".join(f"{k} ×{v}" for k, v in sorted(r["replaced"].items())) or "nothing"
        g0, g1 = t.get("eager, CUDA graph"), t.get("fxkern, CUDA graph")
        lines.append(
            f"| {r['class']} | {what} | {t['eager']:.3f} | {t['export']:.3f} | {t['fxkern']:.3f} "
            f"| {t['eager'] / t['fxkern']:.2f}x | {_ms(g0)} | {_ms(g1)} "
            f"| {f'{g0 / g1:.2f}x' if g0 and g1 else '—'} | {t['inductor']:.3f} "
            f"| {t['eager'] / t['inductor']:.2f}x | {r['rel']:.1e}{'' if r['ok'] else ' (over tolerance)'} "
            f"| {r['export_s']:.1f} + {r['apply_s']:.1f} | {r['compile_s']:.1f} |")
    emit("hf_models", "\n".join(lines), args.section_out)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
