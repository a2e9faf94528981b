"""fxkern.library kernels against eager PyTorch and torch.compile (inductor) on the same pattern.

For each library kernel, at 16384x8192 (and at two of the demo model's own shapes) in float32 and bfloat16 (``--dtypes`` to change), the
kernel time of:

* the library op (``torch.ops.fxkern_lib.<name>``),
* the pattern in eager PyTorch (the op's reference, as the model's code runs it),
* ``torch.compile(pattern, dynamic=False)`` with inductor in its default mode (a static kernel per shape),

as useful GB/s (each input read once, each output written once) against a measured
device-to-device copy. The op is checked against eager first, so a wrong kernel is never timed.

The three are timed in ``--rounds`` rounds, one after another in an order that rotates each round,
and fxkern is compared with inductor round by round. Two kernels at the memory roofline differ by
less than one run's spread, so one median can call either "faster"; the verdict says "faster" only
when fxkern was faster in every round and by at least 1% in the median, "slower" likewise, else
"level".

    python benchmarks/library.py [--section-out FILE] [--dtypes float32,bfloat16] [--rounds 5]

Writes the "library" section of docs/benchmarks.md (or FILE).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

SHAPE = (16384, 8192)
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cases():
    """(label, rule name, make_inputs(dtype) -> args)."""
    from fxkern.library import (deinterleaved_rotary, gelu, interleaved_rotary, layernorm, norm_rotary, rmsnorm, rotary,
                                softmax, swiglu)

    rows, d = SHAPE

    def t(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    def attention(b, h, s, dt):
        """Scores, transformers' causal mask ((b, 1, s, s), finfo.min above the diagonal) and the scale."""
        mask = torch.full((s, s), torch.finfo(dt).min, device="cuda", dtype=dt).triu(1).expand(b, 1, s, s).contiguous()
        return t(b, h, s, s, dtype=dt, scale=3.0), mask, 0.125

    def rope(b, s, h, d, dt):
        """Queries as attention projects them ((b, s, h * d) viewed (b, h, s, d)), cos and sin (1, 1, s, d), half."""
        pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
        emb = pos * (1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d))[None]
        emb = torch.cat((emb, emb), -1)[None, None]
        return t(b, s, h * d, dtype=dt).view(b, s, h, d).transpose(1, 2), emb.cos().to(dt), emb.sin().to(dt), d // 2

    def interleaved(b, s, h, d, rot, dt):
        """Queries as GLM projects them ((b, s, h * d) viewed (b, h, s, d)), cos and sin (1, 1, s, rot) whose
        columns come in pairs (repeat_interleave, as the models build them)."""
        x = rope(b, s, h, d, dt)[0]
        pos = torch.arange(s, device="cuda", dtype=torch.float32)[:, None]
        emb = (pos * (1.0 / 10000 ** (torch.arange(0, rot, 2, device="cuda") / rot))[None]).repeat_interleave(2, -1)
        return x, emb.cos().to(dt)[None, None], emb.sin().to(dt)[None, None]

    def neox(b, s, h, d, rot, dt):
        """GPT-NeoX's queries (a third of each head's fused QKV row), cos and sin (1, 1, s, rot), half, rot."""
        qkv = t(b, s, h * 3 * d, dtype=dt).view(b, s, h, 3 * d).transpose(1, 2)
        _, cos, sin, half = rope(1, s, 1, rot, dt)
        return qkv[..., :d], cos, sin, half, rot

    def heads_norm_rope(b, s, h, d, dt, heads_first):
        """Projected queries or keys as the q/k norm reads them ((b, s, h, d), or Gemma 3's (b, h, s, d) view of
        it), the norm's weight, cos and sin (1, 1, s, d), eps, half."""
        x, cos, sin, half = rope(b, s, h, d, dt)
        return x if heads_first else x.transpose(1, 2), t(d, dtype=dt), cos, sin, 1e-6, half

    return [
        ("RMSNorm (Llama)", "rms_norm", rmsnorm.llama_rmsnorm,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), 1e-6)),
        # nn.RMSNorm / F.rms_norm (torchtitan): eager runs PyTorch's fused kernel
        ("F.rms_norm (nn.RMSNorm, torchtitan)", "torch_rms_norm", rmsnorm.torch_rms_norm,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), d, 1e-6)),
        ("residual add + RMSNorm (Llama)", "add_rms_norm", rmsnorm.add_llama_rmsnorm,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), t(d, dtype=dt), 1e-6)),
        ("residual add + LayerNorm (BERT, GPT-2)", "add_layer_norm", layernorm.add_layer_norm,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), t(d, dtype=dt), t(d, dtype=dt), d, 1e-5)),
        # ModernBERT's norm: nn.LayerNorm(D, bias=False) after the residual add
        ("residual add + LayerNorm, no bias (ModernBERT)", "add_layer_norm_no_bias", layernorm.add_layer_norm_no_bias,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), t(d, dtype=dt), d, 1e-5)),
        ("residual add + LayerNorm written out in float32 (Cohere)", "add_cohere_layer_norm",
         layernorm.add_cohere_layer_norm, lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), t(d, dtype=dt), 1e-5)),
        ("LayerNorm written out in float32 (Cohere)", "cohere_layer_norm", layernorm.cohere_layer_norm,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), 1e-5)),
        # OLMo 1's: neither weight nor bias, F.layer_norm of the float32 upcast, cast back
        ("residual add + LayerNorm, no weight or bias, in float32 (OLMo 1)", "add_olmo_layer_norm",
         layernorm.add_olmo_layer_norm, lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), d, 1e-5)),
        ("LayerNorm, no weight or bias, in float32 (OLMo 1)", "olmo_layer_norm", layernorm.olmo_layer_norm,
         lambda dt: (t(rows, d, dtype=dt), d, 1e-5)),
        # litgpt's RMSNorm: the square written x * x, the weight multiplied in float32
        ("RMSNorm (litgpt)", "litgpt_rms_norm", rmsnorm.litgpt_rmsnorm,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), 1e-6)),
        ("residual add + RMSNorm (litgpt)", "add_litgpt_rms_norm", rmsnorm.add_litgpt_rmsnorm,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt), t(d, dtype=dt), 1e-6)),
        ("SwiGLU", "swiglu", swiglu.swiglu,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt))),
        ("GEGLU, tanh (Gemma)", "geglu_tanh", swiglu.geglu_tanh,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt))),
        ("GEGLU, gelu_new (T5 v1.1)", "geglu_new", swiglu.geglu_new,
         lambda dt: (t(rows, d, dtype=dt), t(rows, d, dtype=dt))),
        ("SwiGLU, chunked halves (Phi-3)", "swiglu_chunked", swiglu.swiglu_chunked,
         lambda dt: (t(rows, 2 * d, dtype=dt),)),
        ("GEGLU, chunked halves (diffusers)", "geglu_chunked", swiglu.geglu_chunked,
         lambda dt: (t(rows, 2 * d, dtype=dt),)),
        # ModernBERT's MLP: the erf GELU on the first half of one projection
        ("GEGLU, chunked halves, GELU on the first (ModernBERT)", "geglu_chunked_gate_first",
         swiglu.geglu_chunked_gate_first, lambda dt: (t(rows, 2 * d, dtype=dt),)),
        # GPT-OSS's expert gate: (tokens, 2 * intermediate) interleaved columns, its alpha and limits
        ("clamped SwiGLU, interleaved pairs (GPT-OSS experts)", "clamped_swiglu", swiglu.clamped_swiglu,
         lambda dt: (t(rows, 2 * d, dtype=dt, scale=4.0), 1.702, 7.0, -7.0, 7.0)),
        ("softmax(-1)", "softmax", softmax.softmax,
         lambda dt: (t(rows, d, dtype=dt, scale=3.0),)),
        ("bias+GELU(erf)", "bias_gelu", gelu.bias_gelu,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt))),
        ("bias+GELU(tanh)", "bias_gelu_tanh", gelu.bias_gelu_tanh,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt))),
        ("bias+GELU(erf)+residual", "bias_gelu_residual", gelu.bias_gelu_residual,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), t(rows, d, dtype=dt))),
        ("bias+GELU(tanh)+residual", "bias_gelu_tanh_residual", gelu.bias_gelu_tanh_residual,
         lambda dt: (t(rows, d, dtype=dt), t(d, dtype=dt), t(rows, d, dtype=dt))),
        ("gelu_new (GPT-2, written out)", "gelu_new", gelu.gelu_new,
         lambda dt: (t(rows, d, dtype=dt),)),
        ("quick_gelu (CLIP)", "quick_gelu", gelu.quick_gelu, lambda dt: (t(rows, d, dtype=dt),)),
        ("Megatron GELU, no bias (BLOOM)", "megatron_gelu", gelu.megatron_gelu, lambda dt: (t(rows, d, dtype=dt),)),
        # the shapes the demo model runs: attention scores of 8x32 heads x 512 keys, and its norms
        ("HF attention softmax, 131072x512", "softmax_float32", softmax.softmax_float32,
         lambda dt: (t(8 * 32 * 512, 512, dtype=dt, scale=3.0),)),
        # transformers' eager attention: scores * scaling + causal mask (b, 1, q, k), softmax, cast back
        ("HF attention scaled masked softmax, 8x32x512x512", "scaled_masked_softmax_float32",
         softmax.scaled_masked_softmax_float32, lambda dt: attention(8, 32, 512, dt)),
        ("HF attention scaled masked softmax, 2x16x2048x2048", "scaled_masked_softmax_float32",
         softmax.scaled_masked_softmax_float32, lambda dt: attention(2, 16, 2048, dt)),
        # a prompt of odd length: its rows are not whole 16-byte packs, so they take the kernels' EDGES grids
        ("HF attention scaled masked softmax, 4x32x1001x1001 (odd length)", "scaled_masked_softmax_float32",
         softmax.scaled_masked_softmax_float32, lambda dt: attention(4, 32, 1001, dt)),
        ("GPT-OSS attention with sinks, 4x32x1001x1001 (odd length)", "sink_masked_softmax",
         softmax.sink_masked_softmax, lambda dt: (*attention(4, 32, 1001, dt)[:2], t(32, dtype=dt), 0.125, 4, 1001)),
        ("Gemma 2 soft-capped masked softmax, 4x16x1001x1001 (odd length)", "softcapped_masked_softmax_float32",
         softmax.softcapped_masked_softmax_float32,
         lambda dt: (t(4, 16, 1001, 1001, dtype=dt, scale=800.0), *attention(4, 16, 1001, dt)[1:2], 0.0625, 50.0)),
        ("HF attention softmax, 131072x1001 (odd length)", "softmax_float32", softmax.softmax_float32,
         lambda dt: (t(8 * 16 * 1024, 1001, dtype=dt, scale=3.0),)),
        # a long context: 8192 keys a row (half of Llama's 32 heads at batch 1: the whole is 2^31 elements, the
        # call fxkern.split cuts in two of these)
        ("HF attention scaled masked softmax, 1x16x8192x8192", "scaled_masked_softmax_float32",
         softmax.scaled_masked_softmax_float32, lambda dt: attention(1, 16, 8192, dt)),
        # GPT-OSS's eager attention (its default): the scaled, masked scores with one sink logit a head
        # concatenated, the max subtracted, a softmax in the scores' dtype, the sinks' column dropped
        ("GPT-OSS attention with sinks, 8x32x512x512", "sink_masked_softmax", softmax.sink_masked_softmax,
         lambda dt: (*attention(8, 32, 512, dt)[:2], t(32, dtype=dt), 0.125, 8, 512)),
        ("GPT-OSS attention with sinks, 2x16x2048x2048", "sink_masked_softmax", softmax.sink_masked_softmax,
         lambda dt: (*attention(2, 16, 2048, dt)[:2], t(16, dtype=dt), 0.125, 2, 2048)),
        ("GPT-OSS attention with sinks, 1x16x8192x8192", "sink_masked_softmax", softmax.sink_masked_softmax,
         lambda dt: (*attention(1, 16, 8192, dt)[:2], t(16, dtype=dt), 0.125, 1, 8192)),
        # Gemma 2's eager attention: scaling 1/16, scores soft-capped at 50 (scores drawn so x * scaling / cap
        # spreads over tanh's curve), causal mask
        ("Gemma 2 soft-capped masked softmax, 8x32x512x512", "softcapped_masked_softmax_float32",
         softmax.softcapped_masked_softmax_float32,
         lambda dt: (t(8, 32, 512, 512, dtype=dt, scale=800.0), *attention(8, 32, 512, dt)[1:2], 0.0625, 50.0)),
        ("Gemma 2 soft-capped masked softmax, 1x16x8192x8192", "softcapped_masked_softmax_float32",
         softmax.softcapped_masked_softmax_float32,
         lambda dt: (t(1, 16, 8192, 8192, dtype=dt, scale=800.0), *attention(1, 16, 8192, dt)[1:2], 0.0625, 50.0)),
        # T5's attention: unscaled scores plus its relative position bias, one (1, h, q, k) tensor shared by the
        # batch, and plus a (b, 1, q, k) mask (T5 4.x adds the two before; a padded batch's mask), float32 softmax
        ("T5 attention masked softmax, 8x32x512x512, (1, 32, 512, 512) position bias", "t5_masked_softmax",
         softmax.t5_masked_softmax, lambda dt: (t(8, 32, 512, 512, dtype=dt, scale=3.0), t(1, 32, 512, 512, dtype=dt))),
        ("T5 attention masked softmax, 8x32x512x512, (8, 1, 512, 512) mask", "t5_masked_softmax",
         softmax.t5_masked_softmax, lambda dt: attention(8, 32, 512, dt)[:2]),
        # transformers' apply_rotary_pos_emb on projected queries: 16x2048 tokens, 32 heads of 128 (16384x8192)
        ("RoPE (transformers), q 16x32x2048x128", "rotary_embedding", rotary.rotary_embedding,
         lambda dt: rope(16, 2048, 32, 128, dt)),
        ("RoPE (transformers), q 8x32x512x64", "rotary_embedding", rotary.rotary_embedding,
         lambda dt: rope(8, 512, 32, 64, dt)),
        # OLMo 1-3: the tables kept in float32 beside 16-bit queries, the products promoted, the sum cast back
        ("RoPE with float32 tables (OLMo), q 16x32x2048x128", "rotary_embedding_float32_tables",
         rotary.rotary_embedding_float32_tables,
         lambda dt: (rope(16, 2048, 32, 128, dt)[0], *rope(1, 2048, 1, 128, torch.float32)[1:])),
        # grouped-query attention as Llama 3 8B has it (8 key/value heads of 128 for 32 query heads), 16x2048
        # tokens: the projected keys rotated and repeated 4 times, the projected values repeated
        ("RoPE + repeat_kv (transformers), k 16x8x2048x128 to 32 heads", "rotary_embedding_repeat_kv",
         rotary.rotary_embedding_repeat_kv, lambda dt: (*rope(16, 2048, 8, 128, dt), 16, 8, 4, 2048, 128, 32)),
        ("repeat_kv (transformers), v 16x8x2048x128 to 32 heads", "repeat_kv", rotary.repeat_kv,
         lambda dt: (rope(16, 2048, 8, 128, dt)[0], 16, 8, 4, 2048, 128, 32)),
        # GPT-NeoX (Pythia): a quarter of each head rotated, the queries a column block of the fused QKV
        # projection's rows, 16x2048 tokens, 32 heads of 128
        ("partial RoPE (transformers, GPT-NeoX), q 16x32x2048x128 of fused QKV, rotary_dim 32",
         "partial_rotary_embedding", rotary.partial_rotary_embedding, lambda dt: neox(16, 2048, 32, 128, 32, dt)),
        # GLM's, GPT-J's and Cohere's interleaved rotation (pairs 2i, 2i + 1) on projected queries
        ("interleaved RoPE (GLM, Cohere), q 16x32x2048x128", "interleaved_rotary_embedding",
         interleaved_rotary.interleaved_rotary_embedding, lambda dt: interleaved(16, 2048, 32, 128, 128, dt)),
        ("interleaved RoPE in float32 (Cohere's 16-bit models), q 16x32x2048x128", "interleaved_rotary_embedding_float32",
         interleaved_rotary.interleaved_rotary_embedding_float32, lambda dt: interleaved(16, 2048, 32, 128, 128, dt)),
        # ERNIE 4.5: float32 tables, the queries and their rotation cast to float32, the sum cast back
        ("interleaved RoPE with float32 tables (ERNIE 4.5), q 16x32x2048x128", "interleaved_rotary_embedding_float32_tables",
         interleaved_rotary.interleaved_rotary_embedding_float32_tables,
         lambda dt: (interleaved(16, 2048, 32, 128, 128, dt)[0], *interleaved(1, 2048, 1, 128, 128, torch.float32)[1:])),
        # DeepSeek-V3's pairs rotated into halves: transformers 5.24's even/odd slices against half-width tables,
        # and the copy (view, transpose, reshape) and rotate_half of 4.x to 5.17 against whole ones
        ("de-interleaving RoPE (DeepSeek-V3, slices), q 16x32x2048x128", "deinterleaved_rotary_embedding",
         deinterleaved_rotary.deinterleaved_rotary_embedding_sliced,
         lambda dt: tuple(a[..., :64] if i else a for i, a in enumerate(rope(16, 2048, 32, 128, dt)[:3]))),
        ("de-interleaving RoPE (DeepSeek-V3, copy + rotate_half), q 16x32x2048x128", "deinterleaved_rotary_embedding",
         deinterleaved_rotary.deinterleaved_rotary_embedding_copied, lambda dt: rope(16, 2048, 32, 128, dt)[:3]),
        # GPT-OSS's torch.chunk halves against half-width tables (freqs' cos and sin)
        ("RoPE (GPT-OSS, chunked halves, half-width tables), q 16x32x2048x128", "chunked_rotary_embedding",
         deinterleaved_rotary.chunked_rotary_embedding,
         lambda dt: tuple(a[..., :64] if i else a for i, a in enumerate(rope(16, 2048, 32, 128, dt)[:3]))),
        ("partial interleaved RoPE (GLM-4), q 16x32x2048x128, rotary_dim 64", "partial_interleaved_rotary_embedding",
         interleaved_rotary.partial_interleaved_rotary_embedding,
         lambda dt: (*interleaved(16, 2048, 32, 128, 64, dt), 64)),
        # Qwen3's and Gemma 3's query and key norms with the rotation after them (32 query heads, 8 key/value
        # heads of 128, 16x2048 tokens): x as each model's norm reads it, (b, s, h, d) and (b, h, s, d)
        ("q norm + RoPE (Qwen3), q 16x2048x32x128", "rms_norm_rotary_embedding", norm_rotary.rms_norm_rotary_embedding,
         lambda dt: heads_norm_rope(16, 2048, 32, 128, dt, heads_first=False)),
        ("q norm + RoPE (Gemma 3), q 16x32x2048x128", "gemma_rms_norm_rotary_embedding",
         norm_rotary.gemma_rms_norm_rotary_embedding, lambda dt: heads_norm_rope(16, 2048, 32, 128, dt, heads_first=True)),
        ("k norm + RoPE + repeat_kv (Qwen3), k 16x2048x8x128 to 32 heads", "rms_norm_rotary_embedding_repeat_kv",
         norm_rotary.rms_norm_rotary_embedding_repeat_kv,
         lambda dt: (*heads_norm_rope(16, 2048, 8, 128, dt, heads_first=False), 16, 8, 4, 2048, 128, 32)),
        ("RMSNorm (Llama), 4096x2048", "rms_norm", rmsnorm.llama_rmsnorm,
         lambda dt: (t(4096, 2048, dtype=dt), t(2048, dtype=dt), 1e-6)),
        ("residual add + RMSNorm (Llama), 4096x2048", "add_rms_norm", rmsnorm.add_llama_rmsnorm,
         lambda dt: (t(4096, 2048, dtype=dt), t(4096, 2048, dtype=dt), t(2048, dtype=dt), 1e-6)),
    ]


def copy_bandwidth() -> float:
    x = torch.randn(1 << 28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = common.cuda_time_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / (ms * 1e-3) / 1e9


def useful_bytes(args, out) -> int:
    outs = out if isinstance(out, tuple) else (out,)
    return (sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
            + sum(o.numel() * o.element_size() for o in outs))


# The smallest difference a verdict names: kernels at the memory roofline differ by tenths of a
# percent that hold within one run (one machine instance) and not across runs.
MARGIN = 0.01


def verdict(ratios: list[float]) -> str:
    """fxkern against inductor over the rounds (each ratio: inductor's time over fxkern's): "faster"
    when faster in every round and by at least MARGIN in the median, "slower" likewise, else "level"."""
    mid = statistics.median(ratios)
    if min(ratios) > 1.0 and mid >= 1.0 + MARGIN:
        return "faster"
    if max(ratios) < 1.0 and mid <= 1.0 - MARGIN:
        return "slower"
    return "level"


def measure(label, rule_name, pattern, make, dtype, copy_gbs, rounds, lead=True):
    import fxkern.library

    op = fxkern.library.rules()[rule_name].op
    args = make(dtype)
    ours_out, eager_out = op(*args), pattern(*args)
    pairs = zip(*(o if isinstance(o, tuple) else (o,) for o in (ours_out, eager_out)))
    err = max(float((a.float() - b.float()).norm() / b.float().norm()) for a, b in pairs)
    if not err <= TOL[dtype]:
        raise AssertionError(f"{label} {dtype}: fxkern op differs from eager by {err:.2e} (rel. norm)")
    compiled = common.inductor(pattern)
    compiled(*args)
    nbytes = useful_bytes(args, ours_out)
    fns = {"fxkern": op, "inductor": compiled, "eager": pattern}
    samples = common.rotated_rounds({name: (lambda fn=fn: fn(*args)) for name, fn in fns.items()}, rounds, lead=lead)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    gbs = {k: nbytes / (v * 1e-3) / 1e9 for k, v in ms.items()}
    ratios = [i / f for i, f in zip(samples["inductor"], samples["fxkern"])]
    return label, str(dtype).removeprefix("torch."), ms, gbs, gbs["fxkern"] / copy_gbs, ratios, err


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section-out", type=Path, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timing, the order rotated each round")
    parser.add_argument("--idle-start", action="store_true",
                        help="start each sample from an idle GPU (the timer before 2026-11-24: it also counts "
                             "one call's host latency a sample)")
    parser.add_argument("--only", action="append", default=None, metavar="TEXT",
                        help="measure only the kernels whose label contains TEXT (case-insensitive; repeat for several)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        # docs/benchmarks.md keeps the section measured on a GPU
        print("library kernels: no GPU on this machine, nothing measured (run it on the device: tools/gpu_suite.sh)")
        return
    import fxkern.library

    torch.manual_seed(0)
    fxkern.library.rules()
    copies = [copy_bandwidth() for _ in range(args.rounds)]
    copy_gbs = statistics.median(copies)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    chosen = [c for c in cases() if args.only is None or any(o.lower() in c[0].lower() for o in args.only)]
    if not chosen:
        parser.error(f"--only {args.only!r} names no kernel")
    rows = []
    for case in chosen:
        for dtype in dtypes:
            rows.append(measure(*case, dtype, copy_gbs, args.rounds, not args.idle_start))
            label, dt, ms, gbs, frac, ratios, _ = rows[-1]
            # a row as soon as it is measured, so a run cut short by a time limit still tells what it got
            print(f"{label} {dt}: {gbs['fxkern']:.0f} GB/s ({frac:.0%} of copy), inductor "
                  f"{gbs['inductor']:.0f}, {statistics.median(ratios):.3f}x", flush=True)
    goal = 0.9 * copy_gbs
    lines = [
        "## Library kernels (`fxkern.library`)",
        "",
        (f"Machine: {common.machine()}. Date: {common.today()}. "
         f"Command: `python benchmarks/library.py --rounds {args.rounds}{' --idle-start' * args.idle_start}"
         f"{''.join(f' --only {shlex.quote(o)}' for o in args.only or ())}`."),
        "",
        (f"Kernel time at {SHAPE[0]}x{SHAPE[1]} (bias: ({SHAPE[1]},)); CUDA events around 10 back-to-back calls, "
         f"{'each sample from an idle GPU' if args.idle_start else 'the GPU kept busy by an untimed call before each sample'}, "
         f"5 warm-ups, median of 20, in {args.rounds} rounds (fxkern, inductor and eager one after another, "
         f"the order rotated each round); times are the median round. Useful bytes: each input read once, "
         f"each output written once. Device-to-device copy: {copy_gbs:.0f} GB/s (median of {args.rounds}, "
         f"{min(copies):.0f}-{max(copies):.0f}); goal: at least 90% of it ({goal:.0f} GB/s) and faster than "
         f"inductor (`torch.compile(pattern, dynamic=False)`, default mode) on the same pattern. \"vs inductor\": inductor's "
         f"time over fxkern's, the median round and the range over rounds; verdict: \"faster\" when fxkern "
         f"was faster in every round and by at least {MARGIN:.0%} in the median, \"slower\" likewise, else "
         f"\"level\"."),
        "",
        ("| kernel | dtype | fxkern ms | eager ms | inductor ms | fxkern GB/s | eager GB/s | inductor GB/s "
         "| fxkern / copy | vs inductor (rounds) | verdict | goal met | rel. err vs eager |"),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | :---: | ---: |",
    ]
    for label, dt, ms, gbs, frac, ratios, err in rows:
        judged = verdict(ratios)
        met = gbs["fxkern"] >= goal and judged == "faster"
        lines.append(
            f"| {label} | {dt} | {ms['fxkern']:.3f} | {ms['eager']:.3f} | {ms['inductor']:.3f} "
            f"| {gbs['fxkern']:.0f} | {gbs['eager']:.0f} | {gbs['inductor']:.0f} | {frac:.0%} "
            f"| {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | {judged} "
            f"| {'yes' if met else 'no'} | {err:.1e} |"
        )
    common.emit("library", "\n".join(lines), args.section_out)


if __name__ == "__main__":
    main()
