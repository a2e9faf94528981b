"""The fused kernels fxkern ships, with the rules that find them in exported models.

    import fxkern, fxkern.library
    ep = fxkern.apply(torch.export.export(model, args), fxkern.library.rules())

One module per kernel family, each holding its CUDA source, its ``KernelSpec`` objects and its
pattern functions (each pattern is also its op's CPU reference):

* :mod:`~fxkern.library.rmsnorm` — Llama/Mistral/Qwen2 ``LlamaRMSNorm``, ``T5LayerNorm``, ``GemmaRMSNorm``,
  ``nn.RMSNorm``, litgpt's ``RMSNorm``, each also fused with the residual add before it;
* :mod:`~fxkern.library.layernorm` — a residual add and the ``nn.LayerNorm`` after it (BERT, GPT-2, ViT;
  ModernBERT's, which has no bias), and Cohere's LayerNorm written out in float32 and OLMo 1's, which has
  neither weight nor bias, with and without the add;
* :mod:`~fxkern.library.gelu` — bias + GELU (+ residual) for erf, tanh, ``gelu_new`` and Megatron GELU (BLOOM's
  without the bias), and CLIP's ``quick_gelu``;
* :mod:`~fxkern.library.swiglu` — ``silu(gate) * up``, ``gelu(gate) * up`` (Gemma, T5), SwiGLU/GEGLU
  over the two halves of one projection (``x.chunk(2, -1)``: Phi-3, diffusers, ModernBERT), and GPT-OSS's
  clamped gate over its projection's interleaved columns;
* :mod:`~fxkern.library.softmax` — softmax over the last axis, HF's and T5's float32 forms too, and
  attention's scaled, masked softmax (``scores * scaling + mask`` or ``scores / sqrt(d) + mask``, then
  softmax), also with Gemma 2's soft-capped scores, and T5's unscaled ``scores + position_bias``;
* :mod:`~fxkern.library.norm_rotary` — a head's RMSNorm and its rotary embedding in one kernel (Qwen3's
  and Gemma 3's queries and keys, the keys also repeated for grouped-query attention);
* :mod:`~fxkern.library.rotary` — rotary position embedding as transformers and litgpt write it,
  ``q * cos + rotate_half(q) * sin``, and GPT-NeoX's and Phi-3's partial rotation with its ``cat``,
  reading queries and keys where the projection left them; and grouped-query attention's
  ``repeat_kv`` of the values, and of the keys with their rotation (one pass);
* :mod:`~fxkern.library.interleaved_rotary` — the interleaved rotary embedding, columns ``2i`` and ``2i + 1``
  a pair (GPT-J, CodeGen, GLM, GLM-4, Cohere 1 and 2), whole or partial;
* :mod:`~fxkern.library.deinterleaved_rotary` — DeepSeek-V3's rotation of pairs ``(2j, 2j + 1)`` into halves
  ``(j, D/2 + j)`` (Kimi K2, GLM-4 MoE Lite, LongCat Flash, Mistral 4), in transformers' old and new forms.

Importing this package registers nothing. :func:`rules` registers every op (``fxkern_lib::*``,
compiled by NVRTC: no GPU needed, cached on disk) and traces every pattern, once per process.
"""

from __future__ import annotations

import threading

from fxkern import compiler
from fxkern.library import (deinterleaved_rotary, gelu, interleaved_rotary, layernorm, norm_rotary, rmsnorm, rotary,
                            softmax, swiglu)
from fxkern.library.deinterleaved_rotary import (
    CHUNKED_ROTARY,
    DEINTERLEAVED_ROTARY,
    chunked_rotary_embedding,
    deinterleaved_rotary_embedding,
)
from fxkern.library.gelu import (
    BIAS_GELU,
    BIAS_GELU_NEW,
    BIAS_GELU_NEW_RESIDUAL,
    BIAS_GELU_RESIDUAL,
    BIAS_GELU_TANH,
    BIAS_GELU_TANH_RESIDUAL,
    GELU_NEW,
    MEGATRON_BIAS_GELU,
    MEGATRON_GELU,
    QUICK_GELU,
    bias_gelu,
    bias_gelu_new,
    bias_gelu_new_residual,
    bias_gelu_residual,
    bias_gelu_tanh,
    bias_gelu_tanh_residual,
    gelu_new,
    megatron_bias_gelu,
    megatron_gelu,
    quick_gelu,
)
from fxkern.library.interleaved_rotary import (
    INTERLEAVED_ROTARY,
    PARTIAL_INTERLEAVED_ROTARY,
    interleaved_rotary_embedding,
    partial_interleaved_rotary_embedding,
)
from fxkern.library.layernorm import (
    ADD_COHERE_LAYER_NORM,
    ADD_LAYER_NORM,
    ADD_LAYER_NORM_NO_BIAS,
    ADD_OLMO_LAYER_NORM,
    COHERE_LAYER_NORM,
    OLMO_LAYER_NORM,
    add_cohere_layer_norm,
    add_layer_norm,
    add_layer_norm_no_bias,
    add_olmo_layer_norm,
    olmo_layer_norm,
    cohere_layer_norm,
)
from fxkern.library.norm_rotary import (
    GEMMA_RMS_NORM_ROTARY,
    GEMMA_RMS_NORM_ROTARY_REPEAT_KV,
    RMS_NORM_ROTARY,
    RMS_NORM_ROTARY_REPEAT_KV,
    gemma_rms_norm_rotary_embedding,
    gemma_rms_norm_rotary_embedding_repeat_kv,
    rms_norm_rotary_embedding,
    rms_norm_rotary_embedding_repeat_kv,
)
from fxkern.library.rmsnorm import (
    ADD_GEMMA_RMS_NORM,
    ADD_LITGPT_RMS_NORM,
    ADD_RMS_NORM,
    GEMMA_RMS_NORM,
    LITGPT_RMS_NORM,
    RMS_NORM,
    add_gemma_rmsnorm,
    add_litgpt_rmsnorm,
    add_llama_rmsnorm,
    add_meta_rmsnorm,
    add_t5_layer_norm,
    gemma_rmsnorm,
    litgpt_rmsnorm,
    llama_rmsnorm,
    meta_rmsnorm,
    t5_layer_norm,
)
from fxkern.library.rotary import (
    PARTIAL_ROTARY,
    PARTIAL_ROTARY_REPEAT_KV,
    REPEAT_KV,
    ROTARY,
    ROTARY_REPEAT_KV,
    partial_rotary_embedding,
    partial_rotary_embedding_repeat_kv,
    repeat_kv,
    rotary_embedding,
    rotary_embedding_repeat_kv,
)
from fxkern.library.softmax import (
    DIVIDED_MASKED_SOFTMAX,
    MASKED_SOFTMAX,
    SCALED_MASKED_SOFTMAX,
    SINK_MASKED_SOFTMAX,
    SOFTCAPPED_MASKED_SOFTMAX,
    SOFTMAX,
    divided_masked_softmax,
    divided_masked_softmax_float32,
    masked_softmax,
    scaled_masked_softmax,
    scaled_masked_softmax_float32,
    sink_masked_softmax,
    softcapped_masked_softmax,
    softcapped_masked_softmax_float32,
    softmax_float32,
    t5_masked_softmax,
    t5_softmax,
)
from fxkern.library.swiglu import CLAMPED_SWIGLU, GEGLU_CHUNKED_GATE_FIRST, SWIGLU, clamped_swiglu, geglu_chunked_gate_first
from fxkern.rules import RuleSet

NAME = "fxkern.library"
# Registration order is rule priority (an overlap goes to the rule added first): GELU's residual
# forms before the add + RMSNorm forms, since `gelu(...) + x` followed by a norm moves fewer bytes
# as a GELU+residual kernel and a plain norm (5 passes) than as a GELU and an add+norm (6); a head's
# norm and rotation before either alone; DeepSeek-V3's copied form before the rotation it holds.
_MODULES = (gelu, norm_rotary, rmsnorm, layernorm, swiglu, softmax, deinterleaved_rotary, rotary, interleaved_rotary)
_lock = threading.Lock()
_rules = None


def rules() -> RuleSet:
    """The library's rules as one ``RuleSet`` named ``"fxkern.library"``, built on first call."""
    global _rules
    if _rules is None:
        with _lock:
            if _rules is None:
                built = RuleSet(NAME)
                with compiler.concurrently():  # a cold cache compiles the kernels side by side
                    for module in _MODULES:
                        module.register(built)
                _rules = built
    return _rules


def op(name: str):
    """The library op ``fxkern_lib::<name>`` (registering the library first)."""
    rs = rules()
    if name not in rs:
        raise KeyError(f"fxkern.library has no op {name!r}; its ops: {', '.join(sorted(r.name for r in rs))}")
    return rs[name].op


__all__ = [
    "ADD_GEMMA_RMS_NORM",
    "ADD_COHERE_LAYER_NORM",
    "ADD_LAYER_NORM",
    "ADD_LAYER_NORM_NO_BIAS",
    "ADD_OLMO_LAYER_NORM",
    "COHERE_LAYER_NORM",
    "OLMO_LAYER_NORM",
    "ADD_LITGPT_RMS_NORM",
    "ADD_RMS_NORM",
    "BIAS_GELU",
    "BIAS_GELU_NEW",
    "BIAS_GELU_NEW_RESIDUAL",
    "BIAS_GELU_RESIDUAL",
    "BIAS_GELU_TANH",
    "BIAS_GELU_TANH_RESIDUAL",
    "CHUNKED_ROTARY",
    "CLAMPED_SWIGLU",
    "DEINTERLEAVED_ROTARY",
    "DIVIDED_MASKED_SOFTMAX",
    "GEGLU_CHUNKED_GATE_FIRST",
    "GELU_NEW",
    "GEMMA_RMS_NORM",
    "GEMMA_RMS_NORM_ROTARY",
    "GEMMA_RMS_NORM_ROTARY_REPEAT_KV",
    "INTERLEAVED_ROTARY",
    "LITGPT_RMS_NORM",
    "MASKED_SOFTMAX",
    "MEGATRON_BIAS_GELU",
    "MEGATRON_GELU",
    "QUICK_GELU",
    "NAME",
    "PARTIAL_INTERLEAVED_ROTARY",
    "PARTIAL_ROTARY",
    "PARTIAL_ROTARY_REPEAT_KV",
    "REPEAT_KV",
    "RMS_NORM",
    "RMS_NORM_ROTARY",
    "RMS_NORM_ROTARY_REPEAT_KV",
    "ROTARY",
    "ROTARY_REPEAT_KV",
    "SCALED_MASKED_SOFTMAX",
    "SINK_MASKED_SOFTMAX",
    "SOFTCAPPED_MASKED_SOFTMAX",
    "SOFTMAX",
    "SWIGLU",
    "add_gemma_rmsnorm",
    "add_cohere_layer_norm",
    "add_layer_norm",
    "add_layer_norm_no_bias",
    "add_olmo_layer_norm",
    "olmo_layer_norm",
    "cohere_layer_norm",
    "add_litgpt_rmsnorm",
    "add_llama_rmsnorm",
    "add_meta_rmsnorm",
    "add_t5_layer_norm",
    "bias_gelu",
    "bias_gelu_new",
    "bias_gelu_new_residual",
    "bias_gelu_residual",
    "bias_gelu_tanh",
    "bias_gelu_tanh_residual",
    "deinterleaved_rotary",
    "chunked_rotary_embedding",
    "clamped_swiglu",
    "deinterleaved_rotary_embedding",
    "divided_masked_softmax",
    "divided_masked_softmax_float32",
    "geglu_chunked_gate_first",
    "gelu",
    "gelu_new",
    "gemma_rms_norm_rotary_embedding",
    "gemma_rms_norm_rotary_embedding_repeat_kv",
    "gemma_rmsnorm",
    "interleaved_rotary",
    "interleaved_rotary_embedding",
    "layernorm",
    "litgpt_rmsnorm",
    "llama_rmsnorm",
    "masked_softmax",
    "megatron_bias_gelu",
    "megatron_gelu",
    "quick_gelu",
    "meta_rmsnorm",
    "norm_rotary",
    "op",
    "partial_interleaved_rotary_embedding",
    "partial_rotary_embedding",
    "partial_rotary_embedding_repeat_kv",
    "repeat_kv",
    "rms_norm_rotary_embedding",
    "rms_norm_rotary_embedding_repeat_kv",
    "rmsnorm",
    "rotary",
    "rotary_embedding",
    "rotary_embedding_repeat_kv",
    "rules",
    "scaled_masked_softmax",
    "scaled_masked_softmax_float32",
    "sink_masked_softmax",
    "softcapped_masked_softmax",
    "softcapped_masked_softmax_float32",
    "softmax",
    "softmax_float32",
    "swiglu",
    "t5_layer_norm",
    "t5_masked_softmax",
    "t5_softmax",
]
