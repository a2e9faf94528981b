"""What fxkern.library matches in transformers model families beyond the benchmarked fourteen, on the CPU:

    python tools/model_survey.py [--models olmo2,cohere] [--dtype bfloat16] [--leftover]

Each family is built small (2 layers, hidden 64, 4 heads, 2 key/value heads where the config has
them) with random weights, exported as tests/test_hf_models.py exports its models, rewritten with
``fxkern.apply(ep, fxkern.library.rules())``, and run on fresh tokens against the exported program
(on the CPU the ops run their references, so "exact" checks the rewrite's wiring, not a kernel).
Prints one line a family: the library calls, and whether the output is the export's to the bit;
``--leftover`` also lists, by the transformers source line that wrote them, the ops left in the
program that library kernels do (norms, activations, softmax, rotary building blocks): where a
rule is missing. A transformers release that writes a family differently shows here first.
Exit status 0 unless a rewrite changed an output or raised.
"""

from __future__ import annotations

import argparse
import linecache
import re
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hf_models import Model  # noqa: E402

VOCAB = 128
_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64)
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# Families whose rewrite the benchmark does not time (hf_models.py has the others), by short name.
FAMILIES = {
    "mixtral": Model("MixtralForCausalLM", "MixtralConfig", {**_LLAMA_LIKE, **_MOE}),
    "qwen3_moe": Model("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {
        **_LLAMA_LIKE, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}),
    "falcon": Model("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0)),
    "phi": Model("PhiForCausalLM", "PhiConfig", {**_LLAMA_LIKE, "num_key_value_heads": 4, "partial_rotary_factor": 0.5}),
    "bloom": Model("BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
    "stablelm": Model("StableLmForCausalLM", "StableLmConfig", {**_LLAMA_LIKE, "partial_rotary_factor": 0.25}),
    "olmo": Model("OlmoForCausalLM", "OlmoConfig", {**_LLAMA_LIKE, "pad_token_id": 1, "eos_token_id": 0}),
    "olmo2": Model("Olmo2ForCausalLM", "Olmo2Config", {**_LLAMA_LIKE, "pad_token_id": 1, "eos_token_id": 0}),
    "cohere": Model("CohereForCausalLM", "CohereConfig", {**_LLAMA_LIKE, **_TOKENS}),
    "granite": Model("GraniteForCausalLM", "GraniteConfig", {
        **_LLAMA_LIKE, "residual_multiplier": 0.22, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "logits_scaling": 8.0}),
    "starcoder2": Model("Starcoder2ForCausalLM", "Starcoder2Config", {**_LLAMA_LIKE, "bos_token_id": 0, "eos_token_id": 0}),
    "gptj": Model("GPTJForCausalLM", "GPTJConfig", dict(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96, bos_token_id=0,
        eos_token_id=0)),
    "glm4": Model("Glm4ForCausalLM", "Glm4Config", {**_LLAMA_LIKE, "head_dim": 16, "pad_token_id": 0}),
    "glm": Model("GlmForCausalLM", "GlmConfig", {**_LLAMA_LIKE, "head_dim": 16, "pad_token_id": 0}),
    "codegen": Model("CodeGenForCausalLM", "CodeGenConfig", dict(
        vocab_size=VOCAB, n_positions=64, n_ctx=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96,
        bos_token_id=0, eos_token_id=0)),
    "cohere2": Model("Cohere2ForCausalLM", "Cohere2Config", {**_LLAMA_LIKE, **_TOKENS, "sliding_window": 8}),
    "ernie4_5": Model("Ernie4_5ForCausalLM", "Ernie4_5Config", {**_LLAMA_LIKE, **_TOKENS, "head_dim": 16}),
    "gpt_oss": Model("GptOssForCausalLM", "GptOssConfig", {**_LLAMA_LIKE, **_MOE, "head_dim": 16, "sliding_window": 8}),
    "smollm3": Model("SmolLM3ForCausalLM", "SmolLM3Config", {**_LLAMA_LIKE, **_TOKENS}),
    "clip_text": Model("CLIPTextModel", "CLIPTextConfig", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, pad_token_id=1, bos_token_id=0, eos_token_id=2), decoder=False),
}

# aten ops that library kernels compute, or build their patterns from: left in a rewritten program,
# each is a place a rule might be missing
_KERNEL_WORK = {"layer_norm", "native_layer_norm", "rms_norm", "rsqrt", "gelu", "silu", "sigmoid", "tanh", "softmax",
                "_softmax", "_safe_softmax", "neg", "repeat_interleave", "stack", "view_as_complex"}


def _source_line(node: torch.fx.Node) -> str:
    """Where transformers wrote ``node``: the last frame of its stack trace in a model's source."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    frame = next((f for f in reversed(frames) if "/transformers/models/" in f[0]), None)
    if frame is None:
        return "?"
    path, line = frame[0], int(frame[1])
    return f"{path.split('/transformers/', 1)[1]}:{line}: {linecache.getline(path, line).strip()}"


def leftover(program: torch.export.ExportedProgram) -> Counter:
    """The ops of ``_KERNEL_WORK`` in ``program``, counted by op and source line."""
    found: Counter = Counter()
    for node in program.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in _KERNEL_WORK and getattr(node.target, "namespace", None) == "aten":
            found[f"{name} @ {_source_line(node)}"] += 1
    return found


def survey(name: str, family: Model, dtype: torch.dtype) -> tuple[Counter, bool, Counter]:
    """(library calls, output exact, ops left) for one family."""
    import fxkern
    import fxkern.library as lib

    model = family.build(dtype, device="cpu")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    program = torch.export.export(model, (tokens,), kwargs=family.kwargs(tokens))
    new = fxkern.apply(program, lib.rules())
    calls = Counter(n.target.name().split("::")[1].split(".")[0] for n in new.graph.nodes
                    if getattr(n.target, "namespace", None) == "fxkern_lib")
    fresh = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    exact = torch.equal(family.output(new.module(), fresh), family.output(program.module(), fresh))
    return calls, exact, leftover(new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--leftover", action="store_true", help="list the ops left that library kernels compute")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(FAMILIES)
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; pick from {', '.join(FAMILIES)}")
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.dtype}")
    failed = False
    for name in names:
        try:
            calls, exact, left = survey(name, FAMILIES[name], getattr(torch, args.dtype))
        except Exception:  # noqa: BLE001 - one family's failure is reported, the others still run
            failed = True
            print(f"{name}: failed\n{traceback.format_exc(limit=3)}")
            continue
        failed |= not exact
        shown = ", ".join(f"{op} x{n}" for op, n in sorted(calls.items())) or "nothing"
        print(f"{name}: {shown}; output {'exact' if exact else 'CHANGED'}")
        if args.leftover:
            for where, n in sorted(left.items()):
                print(f"    left: {where} (x{n})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
