"""The transformers models benchmarks/hf_models.py times, built small on the CPU: each one's norms,
MLP activation, rotary embeddings and (where eager) attention softmax become library ops, and the
rewritten program's output equals the model's. A transformers release that writes one of these
differently fails here, not first in a benchmark run on the GPU."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import fxkern

pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_models  # noqa: E402

import fxkern.library as lib  # noqa: E402

LAYERS = 2
# Grouped-query attention (the Llama-style configs have half as many key/value heads as query heads):
# the queries are rotated, the keys rotated and repeated for each query head in one kernel, the values
# repeated (transformers' repeat_kv).
GQA_ROPE = {"rotary_embedding": LAYERS, "rotary_embedding_repeat_kv": LAYERS, "repeat_kv": LAYERS}
# What each model's rewritten program calls, for LAYERS layers.
EXPECTED = {
    "llama": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, **GQA_ROPE, "swiglu": LAYERS},
    "qwen2": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, **GQA_ROPE, "swiglu": LAYERS},
    "mistral": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, **GQA_ROPE, "swiglu": LAYERS},
    # Phi-3 runs the partial-rotary code (rotate the first rotary_dim columns, concatenate the rest back)
    # with rotary_dim the whole head: its queries go to the partial op, its keys to the rotate-and-repeat one
    "phi3": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, "partial_rotary_embedding": LAYERS,
             "rotary_embedding_repeat_kv": LAYERS, "repeat_kv": LAYERS, "swiglu_chunked": LAYERS},
    "gemma": {"add_gemma_rms_norm": 2 * LAYERS, "gemma_rms_norm": 1, **GQA_ROPE,
              "geglu_tanh": LAYERS},
    # Gemma 2 also normalises the attention's and the MLP's outputs before the residual adds, and its
    # eager attention soft-caps the scores (cap * tanh(x * scaling / cap), then the mask, in one kernel)
    "gemma2": {"add_gemma_rms_norm": 2 * LAYERS, "gemma_rms_norm": 2 * LAYERS + 1, **GQA_ROPE,
               "softcapped_masked_softmax": LAYERS, "geglu_tanh": LAYERS},
    # Gemma 3 adds RMSNorms of the queries and keys, each one kernel with the rotation after it (the
    # keys' with their repeat too)
    "gemma3": {"add_gemma_rms_norm": 2 * LAYERS, "gemma_rms_norm": 2 * LAYERS + 1,
               "gemma_rms_norm_rotary_embedding": LAYERS, "gemma_rms_norm_rotary_embedding_repeat_kv": LAYERS,
               "repeat_kv": LAYERS, "geglu_tanh": LAYERS},
    # Qwen3 normalises each head's queries and keys before the transpose (Llama's numbers), likewise
    "qwen3": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, "rms_norm_rotary_embedding": LAYERS,
              "rms_norm_rotary_embedding_repeat_kv": LAYERS, "repeat_kv": LAYERS, "swiglu": LAYERS},
    # the first block's ln_1 has no residual add before it
    "gpt2": {"add_layer_norm": 2 * LAYERS, "gelu_new": LAYERS},
    # a parallel residual: both branches' norms read the same input, one add joins them
    # and rotates the first quarter of each head (the partial op reads q and k in place, out of the fused
    # QKV projection)
    "gpt_neox": {"add_layer_norm": LAYERS, "partial_rotary_embedding": 2 * LAYERS},
    # each layer's two adds, a reshape to rows or a view back between each and its norm (moved above
    # the add before matching), and the embeddings' sum before the first layer's norm
    "opt": {"add_layer_norm": 2 * LAYERS + 1},
    "t5_encoder": {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, "geglu_new": LAYERS},
    # the embeddings' LayerNorm follows an add of position embeddings broadcast over the batch, which
    # the add + LayerNorm kernel does not read (its filter declines it)
    "bert": {"add_layer_norm": 2 * LAYERS, "scaled_masked_softmax": LAYERS},
    # bias-free norms after each residual add (the first layer's attention norm is an Identity, the
    # embeddings' norm follows no add, the final norm follows the last MLP's add)
    "modernbert": {"add_layer_norm_no_bias": 2 * LAYERS, "geglu_chunked_gate_first": LAYERS},
}


def test_every_benchmarked_model_has_its_expectation():
    assert set(EXPECTED) == set(hf_models.configs(LAYERS))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_is_rewritten_and_keeps_its_output(name):
    spec = hf_models.configs(LAYERS, hidden=64, heads=4, mlp=96, vocab=128, seq=32)[name]
    model = spec.build(torch.float32, device="cpu")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ep = torch.export.export(model, (ids,), kwargs=spec.kwargs(ids))
    new = fxkern.apply(ep, lib.rules(), verify=True)
    replaced = Counter(n.target.name().split("::")[1].split(".")[0] for n in new.graph.nodes
                       if getattr(n.target, "namespace", None) == "fxkern_lib")
    assert dict(replaced) == EXPECTED[name]
    other = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(spec.output(new.module(), other), spec.output(model, other), rtol=0, atol=0)
