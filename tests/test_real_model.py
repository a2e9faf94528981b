"""A model nobody here wrote: a tiny Llama from transformers (built from a config, no downloads),
with rules written against transformers' own LlamaRMSNorm and LlamaMLP code."""

import pytest
import torch
import torch.nn.functional as F

import fxkern
from fxkern import RuleSet
from helpers import count_target, spec_like

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")


from llama_rmsnorm import llama_rmsnorm  # noqa: E402  (the pattern is the example's)


def swiglu(gate, up):
    # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), with act_fn = silu
    return F.silu(gate) * up


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    return model, ep, ids


@pytest.fixture(scope="module")
def rules():
    rs = RuleSet("llama")
    norm = fxkern.replace(llama_rmsnorm, spec_like(llama_rmsnorm), name="test_llama::rmsnorm", rules=rs)
    glu = fxkern.replace(swiglu, spec_like(swiglu), name="test_llama::swiglu", rules=rs)
    return rs, norm, glu


def test_llama_norms_and_gates_are_replaced_and_outputs_kept(llama, rules):
    model, ep, ids = llama
    rs, norm, glu = rules
    report = fxkern.explain(ep, rs)
    assert len(report["rmsnorm"].matches) == 5  # 2 layers x 2 norms + the final norm
    assert len(report["swiglu"].matches) == 2
    new = fxkern.apply(ep, rs, verify=True)
    assert count_target(new, norm.op) == 5 and count_target(new, glu.op) == 2
    other = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(new.module()(other, use_cache=False).logits, model(other, use_cache=False).logits)
    # every norm's eps was captured from the model, not taken from the pattern
    eps = {n.args[2] for n in new.graph.nodes if n.target == norm.op.default}
    assert eps == {1e-5}
