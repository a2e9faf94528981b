"""fxkern.library's rules on models written the way libraries write them (CPU: the ops run their
references, so outputs must stay equal), and the shapes of code they must not touch."""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import Fn
from torch import nn

import fxkern
import fxkern.library as lib
from fxkern.demo import repeat_kv  # transformers' repeat_kv, line for line
from fxkern import symbolic

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")
from transformers.activations import GELUActivation, GELUTanh, NewGELUActivation


@pytest.fixture(scope="module")
def rules():
    return lib.rules()


def replaced(module, *args, dtype=torch.float32):
    """Export, apply the library (verify=True), check outputs, return {rule op name: count}."""
    module = module.to(dtype).eval()
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    ep = torch.export.export(module, args)
    new = fxkern.apply(ep, lib.rules(), verify=True)
    with torch.no_grad():
        torch.testing.assert_close(new.module()(*args), module(*args), rtol=0, atol=0)
    return library_calls(new)


def library_calls(program):
    """{library op name: calls} in a rewritten program."""
    counts = {}
    for n in program.graph.nodes:
        if getattr(n.target, "namespace", None) == "fxkern_lib":
            name = n.target.name().split("::")[1].split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_rule_set_is_named_built_once_and_complete(rules):
    assert rules is lib.rules() and rules.name == "fxkern.library"
    assert {"rms_norm", "t5_layer_norm", "meta_rms_norm", "add_meta_rms_norm", "gemma_rms_norm", "add_rms_norm",
            "add_t5_layer_norm",
            "add_gemma_rms_norm", "bias_gelu", "bias_gelu_residual", "bias_gelu_tanh",
            "bias_gelu_tanh_residual", "gelu_new", "bias_gelu_new", "bias_gelu_new_residual",
            "megatron_bias_gelu", "megatron_gelu", "swiglu", "geglu", "geglu_tanh", "geglu_new", "softmax", "softmax_float32", "scaled_masked_softmax",
            "litgpt_rms_norm", "add_litgpt_rms_norm", "add_layer_norm_no_bias", "geglu_chunked_gate_first", "masked_softmax",
            "t5_masked_softmax", "t5_softmax", "quick_gelu", "cohere_layer_norm", "add_cohere_layer_norm", "olmo2_rms_norm", "add_olmo2_rms_norm", "masked_softmax_float32",
            "scaled_masked_softmax_float32", "divided_masked_softmax", "divided_masked_softmax_float32",
            "softcapped_masked_softmax", "softcapped_masked_softmax_float32", "sink_masked_softmax", "rotary_embedding",
            "add_layer_norm", "clamped_swiglu", "add_olmo_layer_norm", "olmo_layer_norm",
            "interleaved_rotary_embedding_float32_tables", "interleaved_rotary_embedding_float32_casts",
            "partial_rotary_embedding", "whole_rotary_embedding", "repeat_kv", "rotary_embedding_repeat_kv",
            "whole_rotary_embedding_repeat_kv", "partial_rotary_embedding_repeat_kv", "rms_norm_rotary_embedding",
            "gemma_rms_norm_rotary_embedding", "rms_norm_rotary_embedding_repeat_kv",
            "gemma_rms_norm_rotary_embedding_repeat_kv", "interleaved_rotary_embedding",
            "interleaved_rotary_embedding_float32", "partial_interleaved_rotary_embedding",
            "whole_interleaved_rotary_embedding"} <= {r.name for r in rules}
    assert all(str(r.op).startswith("fxkern_lib.") for r in rules)
    # a rewritten model runs every size the original ran: calls past a kernel's 32-bit sizes run in pieces
    # or run the pattern (tests/test_split.py checks which may be cut)
    assert [r.name for r in rules if fxkern.kernel_op(r.op._qualified_op_name).past_limits == "raise"] == []
    # every tensor input comes before the scalars (TensorRT plugins need that)
    for spec in (lib.RMS_NORM, lib.GEMMA_RMS_NORM, lib.ADD_RMS_NORM, lib.SOFTMAX, lib.SWIGLU, lib.BIAS_GELU_RESIDUAL,
                 lib.SCALED_MASKED_SOFTMAX, lib.DIVIDED_MASKED_SOFTMAX, lib.SOFTCAPPED_MASKED_SOFTMAX,
                 lib.SINK_MASKED_SOFTMAX, lib.ROTARY,
                 lib.PARTIAL_ROTARY, lib.ROTARY_REPEAT_KV, lib.PARTIAL_ROTARY_REPEAT_KV, lib.REPEAT_KV, lib.ADD_LAYER_NORM,
                 lib.RMS_NORM_ROTARY, lib.GEMMA_RMS_NORM_ROTARY, lib.RMS_NORM_ROTARY_REPEAT_KV,
                 lib.GEMMA_RMS_NORM_ROTARY_REPEAT_KV, lib.ADD_LAYER_NORM_NO_BIAS, lib.LITGPT_RMS_NORM,
                 lib.ADD_LITGPT_RMS_NORM, lib.MASKED_SOFTMAX, lib.GEGLU_CHUNKED_GATE_FIRST, lib.INTERLEAVED_ROTARY,
                 lib.PARTIAL_INTERLEAVED_ROTARY, lib.CLAMPED_SWIGLU, lib.ADD_OLMO_LAYER_NORM,
                 lib.OLMO_LAYER_NORM):
        kinds = [type(d).__name__ for d in spec.inputs]
        assert kinds == sorted(kinds, key=lambda k: k != "InputDecl")


def _structure(pattern):
    """A traced pattern's ops and how they connect, names aside."""
    import torch.fx as fx

    index = {n: i for i, n in enumerate(pattern.graph.nodes)}
    ref = lambda a: ("node", index[a]) if isinstance(a, fx.Node) else a  # noqa: E731
    return [(n.op, str(n.target), fx.node.map_aggregate(n.args, ref), fx.node.map_aggregate(n.kwargs, ref))
            for n in pattern.graph.nodes if n.op == "call_function"] + [[index[o] for o in pattern.outputs]]


@pytest.mark.parametrize("ir, dtype", [("core_aten", torch.float32), ("core_aten", torch.bfloat16),
                                       ("tensorrt", torch.float16)])
def test_the_library_decomposed_together_is_the_library_decomposed_one_by_one(rules, ir, dtype):
    """A first apply decomposes its rules' patterns as one program, which is 5x faster than one by
    one: every pattern must come out as its own run_decompositions() makes it (torch's
    decompositions are op by op; export takes a tensor passed twice as one input, which the first
    version missed)."""
    from fxkern import patterns

    requests = [(r.pattern, r.examples(dtype)) for r in rules if r.irs is None or ir in r.irs]
    graphs = patterns.decompose_together(requests, ir)
    assert all(g is not None for g in graphs)
    for (fn, ex), graph in zip(requests, graphs):
        together = patterns.trace(fn, ir, example_inputs=ex, graph=graph)
        alone = patterns.trace(fn, ir, example_inputs=ex)
        assert _structure(together) == _structure(alone), fn.__name__


def _doubles_in_place(x):
    x.mul_(2)
    return x + 1


def _adds_in_place(y):
    y.add_(3)
    return y * 5


def _nested_outputs(x):
    s = torch.sigmoid(x)
    return s, (s * 2, s - 1)


def _flat_twice(x):
    return (x.reshape(32) * 2).reshape(4, 8)


@pytest.mark.parametrize("case", ["in place", "nested outputs", "one function, two layouts"])
def test_patterns_decomposed_together_come_out_as_alone(case):
    """Found by a review of the first version: patterns mutating their inputs (export returns the
    mutated inputs first, and the split gave each pattern its input as its result: a wrong program),
    a nested tuple of outputs (one dropped), and one function traced for two layouts (keyed alike,
    one graph served both). Each pattern comes out as its own trace, or is left to it."""
    from fxkern import patterns

    requests = {
        "in place": [(_doubles_in_place, [torch.randn(4, 8)]), (_adds_in_place, [torch.randn(4, 8)])],
        "nested outputs": [(_nested_outputs, [torch.randn(4, 8)]), (_nested_outputs, [torch.randn(2, 8)])],
        "one function, two layouts": [(_flat_twice, [torch.randn(4, 8)]), (_flat_twice, [torch.randn(8, 4).t()])],
    }[case]
    graphs = patterns.decompose_together(requests)
    assert (graphs == [None, None]) if case == "in place" else all(g is not None for g in graphs)
    for (fn, ex), graph in zip(requests, graphs):
        if graph is not None:
            together = patterns.trace(fn, "core_aten", example_inputs=ex, graph=graph)
            assert _structure(together) == _structure(patterns.trace(fn, "core_aten", example_inputs=ex)), fn.__name__


def test_a_pattern_reading_a_tensor_it_does_not_take_is_refused_at_registration():
    """A closed-over tensor became an input of the trace, and replace() failed with KeyError:
    'tensors_0' (found by a review)."""
    from fxkern import RuleSet
    from fxkern.errors import SpecError
    from helpers import spec_like

    table = torch.randn(8)

    def scaled(x):
        return x * table

    with pytest.raises(SpecError, match="reads a tensor it does not take as a parameter"):
        fxkern.replace(scaled, spec_like(scaled), rules=RuleSet("closure"))


def test_every_library_kernel_compiles_for_blackwell(rules):
    """The library on an sm_100 GPU: its kernels compile and their PTX parameters pass the signature
    check (NVRTC writes Blackwell's pointers as ``.param .u64 .ptr .align 1``, which the check once
    refused for every kernel). The first launch on such a GPU compiles exactly this. Compiled: a cover
    of the library's ops (84 of 140 on 2026-11-28), so that every kernel function in each of its paths (EDGES or not,
    fetched first or not) and every ``#define`` line a grid sets (block sizes, packs, reductions)
    compiles at least once, side by side; all of them one after another took 280 of CI's 800 s.
    Registration compiles every op for sm_90."""
    from fxkern import compiler
    from fxkern.ops import compile_plan, registered_ops

    entries = sorted((e for e in registered_ops() if e.qualname.startswith("fxkern_lib::") and e.plan is not None),
                     key=lambda e: e.qualname)
    assert len(entries) > 60

    def on(e, macro: str) -> bool:
        return f"#define {macro} 1\n" in e.source  # a grid's prefix; the source's own defaults are 0

    def features(e):
        path = (e.spec.kernel_name, on(e, "FXK_EDGES"), on(e, "FXK_MASK_FETCH_FIRST"))
        return {e.spec.kernel_name, path} | {" ".join(line.split()[1:3]) for line in e.source.splitlines()
                                             if line.startswith("#define ")}

    wanted, cover = set().union(*map(features, entries)), []
    while wanted:
        best = max(entries, key=lambda e: len(features(e) & wanted))
        cover.append(best)
        wanted -= features(best)
    assert {e.spec.kernel_name for e in cover} == {e.spec.kernel_name for e in entries}
    for kernel in {e.spec.kernel_name for e in entries if on(e, "FXK_EDGES") and on(e, "FXK_MASK_FETCH_FIRST")}:
        assert any(e.spec.kernel_name == kernel and on(e, "FXK_EDGES") and on(e, "FXK_MASK_FETCH_FIRST") for e in cover)
    with compiler.concurrently():
        for e in cover:
            compiler.later(lambda e=e: compile_plan(e.plan, e.source, "sm_100"))


def test_importing_fxkern_does_not_import_the_library():
    code = "import sys, fxkern; assert 'fxkern.library' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- RMSNorm ------------------------------------------------------------------------------------


def tiny_llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def test_llama_norms_mlp_and_attention_softmax(rules):
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    new = fxkern.apply(ep, rules, verify=True)
    targets = [n.target for n in new.graph.nodes]
    # 2 norms per layer + the final one: the first reads the embeddings, the others follow a residual add
    assert targets.count(lib.op("rms_norm").default) == 1
    assert targets.count(lib.op("add_rms_norm").default) == 2
    assert targets.count(lib.op("swiglu").default) == 1
    # HF eager attention: scores * scaling + causal mask, a float32 softmax cast back: one kernel
    assert targets.count(lib.op("scaled_masked_softmax").default) == 1
    eps = {n.args[2] for n in new.graph.nodes if n.target == lib.op("rms_norm").default}
    eps |= {n.args[3] for n in new.graph.nodes if n.target == lib.op("add_rms_norm").default}
    assert eps == {1e-5}
    other = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(new.module()(other, use_cache=False).logits, model(other, use_cache=False).logits)


def test_llama_bfloat16_norms_and_softmax(rules):
    model = tiny_llama(torch.bfloat16)
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 16)),), kwargs={"use_cache": False})
    report = fxkern.explain(ep, rules)
    assert len(report["rms_norm"].matches) == 1 and len(report["add_rms_norm"].matches) == 2
    assert len(report["scaled_masked_softmax_float32"].matches) == 1


def test_the_rewritten_program_keeps_the_exports_dtype_guards(rules):
    """export asserts a tensor's dtype before each ``.to()``. A rule that replaces the cast leaves the
    assertion, which may be the program's only check of its input's dtype, so the rewritten program
    refuses an input of another dtype as the original does (ep.module() checks no input dtypes)."""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            return lib.rmsnorm.llama_rmsnorm(x * 2, self.weight, 1e-6)

    model, x = Norm().to(torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    ep = torch.export.export(model, (x,))
    new = fxkern.apply(ep, rules)
    assert any(getattr(n.target, "namespace", None) == "fxkern_lib" for n in new.graph.nodes)
    for program in (ep, new):
        with pytest.raises(RuntimeError, match="(?i)dtype"):
            program.module()(x.float())
    torch.testing.assert_close(new.module()(x), model(x), rtol=0, atol=0)


def test_llama_bfloat16_swiglu(rules):
    """A pattern whose graph is the same in float32 and bfloat16 still matches bfloat16 anchors
    in a graph that also has float32 ones (Llama's norms compute in float32)."""
    model = tiny_llama(torch.bfloat16)
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 16)),), kwargs={"use_cache": False})
    assert len(fxkern.explain(ep, rules)["swiglu"].matches) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_t5_and_gemma_norms(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    x = torch.randn(2, 8, 64)
    assert replaced(T5LayerNorm(64), x, dtype=dtype) == {"rms_norm": 1}
    gemma = GemmaRMSNorm(64)
    nn.init.normal_(gemma.weight)
    assert replaced(gemma, x, dtype=dtype) == {"gemma_rms_norm": 1}


class NormedHeads(nn.Module):
    """Gemma 3's attention: the queries normalised after the transpose, a (B, H, S, D) view of the
    (B, S, H, D) projection (transformers' Gemma3Attention: ``self.q_norm(query_states)``)."""

    def __init__(self, norm, heads=4, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.proj, self.norm = nn.Linear(heads * head_dim, heads * head_dim), norm

    def forward(self, h):
        b, s, _ = h.shape
        return self.norm(self.proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2))


@pytest.mark.parametrize("family", ["gemma", "llama"])
def test_norm_of_transposed_heads_keeps_eager_layout(rules, family):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = GemmaRMSNorm(8) if family == "gemma" else LlamaRMSNorm(8)
    nn.init.normal_(norm.weight)
    model = NormedHeads(norm).eval()
    h = torch.randn(2, 5, 32)
    batch, seq = torch.export.Dim("batch", min=2, max=64), torch.export.Dim("seq", min=2, max=4096)
    ep = torch.export.export(model, (h,), dynamic_shapes={"h": {0: batch, 1: seq}})
    new = fxkern.apply(ep, rules, verify=True)
    (node,) = [n for n in new.graph.nodes if n.op == "call_function" and "fxkern_lib" in str(n.target)]
    assert "rms_norm" in str(node.target)
    for x in (h, torch.randn(3, 7, 32)):
        want = model(x)
        got = new.module()(x)
        # eager's elementwise ops leave the result in x's layout, the (B, S, H, D) memory order; so do
        # the op's fake impl (what export records) and its CPU and CUDA impls
        assert want.stride() == got.stride() == (x.shape[1] * 32, 8, 32, 1)
        torch.testing.assert_close(got, want)
    # the op's fake impl and its CPU impl agree on that layout (opcheck compares their strides), and a
    # contiguous x gives a contiguous result, as before
    op = lib.op("gemma_rms_norm" if family == "gemma" else "rms_norm")
    weight = norm.weight.detach()
    for x in (torch.randn(2, 5, 4, 8).transpose(1, 2), torch.randn(2, 4, 5, 8)):
        torch.library.opcheck(op, (x, weight, 1e-6))
        assert op(x, weight, 1e-6).stride() == x.stride()


class PreNorm(nn.Module):
    """A pre-norm sublayer as decoders write it: the residual sum feeds the norm and the next add."""

    def __init__(self, norm):
        super().__init__()
        self.norm, self.proj = norm, nn.Linear(64, 64)

    def forward(self, x, residual):
        h = x + residual
        return self.proj(self.norm(h)) + h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_residual_add_fuses_into_each_norm_form(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    x, r = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    gemma = GemmaRMSNorm(64)
    nn.init.normal_(gemma.weight)
    assert replaced(PreNorm(LlamaRMSNorm(64)), x, r, dtype=dtype) == {"add_rms_norm": 1}
    assert replaced(PreNorm(T5LayerNorm(64)), x, r, dtype=dtype) == {"add_rms_norm": 1}
    assert replaced(PreNorm(gemma), x, r, dtype=dtype) == {"add_gemma_rms_norm": 1}


@pytest.mark.parametrize("eps", [1e-6, None], ids=["eps", "default_eps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_torch_rmsnorm_module_alone_and_after_a_residual_add(dtype, eps):
    """nn.RMSNorm / F.rms_norm: one aten.rms_norm node in the export IR, the row length a literal;
    after torchtitan's residual add (``h = x + attention(...)``, then ``ffn_norm(h)``) the two fuse."""
    norm = nn.RMSNorm(64, eps=eps)
    nn.init.normal_(norm.weight)
    plain = "torch_rms_norm" if eps is not None else "torch_rms_norm_default_eps"
    assert replaced(norm, torch.randn(2, 8, 64), dtype=dtype) == {plain: 1}
    assert replaced(norm, torch.randn(5, 64), dtype=dtype) == {plain: 1}
    x, r = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    assert replaced(PreNorm(norm), x, r, dtype=dtype) == {f"add_{plain}": 1}
    # a residual that broadcasts is not the kernel's x + residual: only the norm is replaced
    assert replaced(PreNorm(norm), x, torch.randn(64), dtype=dtype) == {plain: 1}


def test_torch_rmsnorm_near_misses_and_checks():
    # normalised over the last two axes: not a row norm
    assert replaced(nn.RMSNorm([8, 64], eps=1e-6), torch.randn(2, 8, 64)) == {}
    # no weight (elementwise_affine=False): the kernel needs one
    assert replaced(nn.RMSNorm(64, eps=1e-6, elementwise_affine=False), torch.randn(2, 8, 64)) == {}
    with pytest.raises(RuntimeError, match="normalized_shape"):  # the reference (CPU) checks like F.rms_norm
        lib.op("torch_rms_norm")(torch.randn(3, 64), torch.randn(64), 32, 1e-6)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        lib.op("add_torch_rms_norm")(torch.randn(3, 64), torch.randn(3, 64), torch.randn(64), 32, 1e-6)


def test_add_rmsnorm_op_returns_norm_then_sum_and_checks_the_residual():
    x, r, w = torch.randn(3, 5, 64), torch.randn(3, 5, 64), torch.randn(64)
    y, h = lib.op("add_rms_norm")(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, lib.llama_rmsnorm(x + r, w, 1e-6))
    with pytest.raises(fxkern.KernelInputError, match="'residual' has shape"):
        lib.op("add_rms_norm")(x, torch.randn(5, 1, 64), w, 1e-6)


def test_long_rows_take_the_two_read_kernel():
    tuning = lib.rmsnorm.two_read_tuning
    f32, f32_8k, half = (next(t for t in lib.rmsnorm.TWO_READ if t.name == n) for n in ("32bit", "32bit_8k", "16bit"))
    x, w = torch.randn(3, 4096), torch.randn(4096)
    assert tuning(x, w) is f32 and tuning(torch.randn(3, 8188), torch.randn(8188)) is f32
    # float32 rows of 8192+ read the whole row in one step
    assert tuning(torch.randn(2, 5, 8192), torch.randn(8192)) is f32_8k
    assert tuning(torch.randn(2, 20480), torch.randn(20480)) is f32_8k
    assert tuning(x, w.view(1, 4096)) is f32  # a (1, D) weight is one row too
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit rows from 8192 elements
        assert tuning(torch.randn(3, 8192, dtype=dtype), torch.randn(8192, dtype=dtype)) is half
        assert tuning(x.to(dtype), w.to(dtype)) is None
    assert tuning(torch.randn(3, 4092), torch.randn(4092)) is None  # shorter rows: the register-resident kernel
    assert tuning(torch.randn(3, 4098), torch.randn(4098)) is None  # not whole 16-byte packs
    assert tuning(x, w.half()) is None  # mixed dtypes: the register-resident op refuses them
    assert tuning(x.double(), w.double()) is None
    assert tuning(x, torch.randn(3, 4096)) is None  # a weight that is not one row
    shifted = torch.randn(3 * 4096 + 1)[1:].view(3, 4096)  # 4 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 and tuning(shifted, w) is None and tuning(x, torch.randn(4097)[1:]) is None
    strided = torch.randn(3 * 4096 + 1)[1:].view(4096, 3).t()  # copied to a fresh buffer before launch
    assert strided.data_ptr() % 16 and tuning(strided, w) is f32
    assert tuning(torch.tensor(1.0), torch.randn(1)) is None
    # Cohere's plain LayerNorm has a table of its own: a step covering the row (threads x packs x 16 B)
    cohere = lib.rmsnorm.by_element_size(lib.layernorm.COHERE_TWO_READ)
    for d, dtype in ((4096, torch.float32), (8192, torch.float32), (8192, torch.bfloat16), (16384, torch.float16)):
        t = tuning(torch.randn(2, d, dtype=dtype), torch.randn(d, dtype=dtype), cohere)
        assert t in lib.layernorm.COHERE_TWO_READ and t.threads * t.packs * 16 == d * t.element_size, (d, dtype)
    assert tuning(torch.randn(2, 4096, dtype=torch.bfloat16), torch.randn(4096, dtype=torch.bfloat16), cohere) is None
    assert tuning(torch.randn(2, 16384), torch.randn(16384), cohere).name == "32bit_8k"  # longer rows: two steps


def test_softmax_picks_its_grid_by_row_length_dtype_and_alignment(rules):
    sm = lib.softmax
    grid_for, fine, coarse = sm.grid_for, sm.ROWS_32BIT, sm.ROWS
    # Short rows in whole 16-byte packs: small blocks, a register-full a block by element size.
    assert grid_for(torch.randn(3, 512)) == sm.ROWS_SHORT_32BIT == grid_for(torch.randn(2, 4, 1024))
    for dtype in (torch.bfloat16, torch.float16):
        assert grid_for(torch.randn(3, 2048, dtype=dtype)) == sm.ROWS_SHORT == grid_for(torch.randn(3, 8, dtype=dtype))
        assert grid_for(torch.randn(3, 2056, dtype=dtype)) == coarse  # a 16-bit block holds 16384 elements
        # not whole packs: the grid for a pack less one element more, its EDGES kernel
        assert grid_for(torch.randn(3, 1020, dtype=dtype)) == sm.ROWS_SHORT + sm.EDGES
        assert grid_for(torch.randn(3, 2042, dtype=dtype)) == coarse + sm.EDGES
    # Longer float32 rows a 256-thread block holds: the block per 8192 elements.
    assert grid_for(torch.randn(3, 1028)) == fine and grid_for(torch.randn(2, 4, 8192)) == fine
    assert grid_for(torch.randn(3, 1022)) == fine + sm.EDGES  # not whole packs: 1025 elements span 257 packs
    shifted = torch.randn(3 * 512 + 1)[1:].view(3, 512)  # 4 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 and grid_for(shifted) == fine  # the scalar path
    assert grid_for(torch.randn(512, 3).t()) == sm.ROWS_SHORT_32BIT  # copied to an aligned buffer first
    assert grid_for(torch.randn(3, 8193)) == coarse  # longer rows: a block a row, not blocks without one
    assert grid_for(torch.tensor(1.0)) == coarse  # the op's own check refuses it

    def blocks(name, shape):  # the grid each private op launches for x of this shape
        (grid_x, *_) = [symbolic.compile_expr(g) for g in fxkern.kernel_op(name).plan.grid]
        return grid_x(([shape], [shape]))

    assert blocks(fine, (131072, 512)) == 8192 and blocks(coarse, (131072, 512)) == 4096
    assert blocks(sm.ROWS_SHORT_32BIT, (131072, 512)) == 65536 and blocks(sm.ROWS_SHORT, (131072, 512)) == 32768
    assert fxkern.kernel_op(sm.ROWS_SHORT_32BIT).plan.block[0] == 64 and fxkern.kernel_op(sm.ROWS_SHORT).plan.block[0] == 32


def test_rmsnorm_near_misses_are_left_alone():
    x, w = torch.randn(4, 8, 64), torch.randn(64)

    def over_first_axis(x, w):
        h = x.to(torch.float32)
        return w * (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)

    def divides_by_sqrt(x, w):  # the same numbers to rounding, but not the ops the rule names
        h = x.to(torch.float32)
        return w * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def full_weight(x, w):  # a (…, D) "weight" is not a row weight: the kernel cannot take it
        h = x.to(torch.float32)
        return (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))

    assert replaced(Fn(over_first_axis), x, w) == {}
    assert replaced(Fn(divides_by_sqrt), x, w) == {}
    assert replaced(Fn(full_weight), x, torch.randn(4, 8, 64)) == {}

    def bias_then_norm(x, b, w):  # x + (D,) bias: not a residual add; the norm alone is replaced
        return lib.llama_rmsnorm(x + b, w, 1e-6)

    assert replaced(Fn(bias_then_norm), x, torch.randn(64), w) == {"rms_norm": 1}


class LitGPTRMSNorm(nn.Module):
    """litgpt's ``RMSNorm`` (Lightning-AI/litgpt ``litgpt/model.py``), as written there."""

    def __init__(self, size, dim=-1, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.dim = dim
        self.add_unit_offset = add_unit_offset

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        # NOTE: the original RMSNorm paper implementation is not equivalent
        norm_x = torch.mean(x * x, dim=self.dim, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        weight = (1 + self.weight) if self.add_unit_offset else self.weight
        return (x_normed * weight.float()).to(dtype=dtype)


class LitGPTBlock(nn.Module):
    """litgpt's ``Block.forward`` with a sequential residual, attention and MLP as linears."""

    def __init__(self, add_unit_offset=False):
        super().__init__()
        self.norm_1, self.norm_2 = (LitGPTRMSNorm(64, add_unit_offset=add_unit_offset) for _ in range(2))
        for norm in (self.norm_1, self.norm_2):
            nn.init.normal_(norm.weight)
        self.attn, self.mlp = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        x_normed = self.norm_1(x)
        attention_output = self.attn(x_normed)
        x = attention_output + x
        x = self.mlp(self.norm_2(x)) + x
        return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_litgpt_rmsnorm_with_x_times_x_is_found_with_and_without_its_residual_add(dtype):
    """litgpt squares with ``x * x`` (a ``mul`` in every IR, where Llama's ``pow(2)`` is a ``pow``) and
    multiplies the weight in float32 (F.rms_norm's numbers). Its Gemma form (``add_unit_offset``) adds 1
    to the weight in the weight's dtype before the upcast: the op reads that sum as its weight."""
    x = torch.randn(2, 8, 64)
    assert replaced(LitGPTBlock(), x, dtype=dtype) == {"litgpt_rms_norm": 1, "add_litgpt_rms_norm": 1}
    # In 16-bit, export asserts the sum's dtype before its upcast, ahead of norm_2's ``1 + weight``: the
    # op would have to run before its weight is computed (the rewrite moves no nodes), so the add and
    # the plain norm are replaced apart there
    fused = {"litgpt_rms_norm": 1, "add_litgpt_rms_norm": 1}
    assert replaced(LitGPTBlock(add_unit_offset=True), x, dtype=dtype) == (
        fused if dtype == torch.float32 else {"litgpt_rms_norm": 2})
    # core ATen (and the IRs made from it) too
    model = LitGPTBlock().to(dtype).eval()
    ep = torch.export.export(model, (x.to(dtype),)).run_decompositions()
    assert sorted(m.rule for m in fxkern.explain(ep, lib.rules()).matches) == ["add_litgpt_rms_norm", "litgpt_rms_norm"]
    new = fxkern.apply(ep, lib.rules(), verify=True)
    with torch.no_grad():
        torch.testing.assert_close(new.module()(x.to(dtype)), model(x.to(dtype)), rtol=0, atol=0)


def test_squares_written_otherwise_and_litgpt_near_misses():
    """``x ** 2`` exports as ``pow(x, 2)``: Llama's pattern finds it. ``torch.square`` stays
    ``aten.square`` in the export IR (no rule looks for it there: no popular library writes a weighted
    RMSNorm with it) and becomes ``pow`` in core ATen, where Llama's pattern finds it. litgpt's form over
    another axis, or with two different tensors multiplied, is not a row norm of x."""
    x, w = torch.randn(4, 8, 64), torch.randn(64)

    def llama_written(square):
        def norm(x, w):
            h = x.to(torch.float32)
            return w * (h * torch.rsqrt(square(h).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return norm

    assert replaced(Fn(llama_written(lambda h: h ** 2)), x, w) == {"rms_norm": 1}
    squared = Fn(llama_written(torch.square))
    assert replaced(squared, x, w) == {}
    ep = torch.export.export(squared, (x, w)).run_decompositions()
    assert [m.rule for m in fxkern.explain(ep, lib.rules()).matches] == ["rms_norm"]

    def over_first_axis(x, w):
        h = x.float()
        return (h * torch.rsqrt(torch.mean(h * h, dim=0, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    def two_tensors(x, y, w):
        h = x.float()
        return (h * torch.rsqrt(torch.mean(h * y.float(), dim=-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    assert replaced(Fn(over_first_axis), x, w) == {}
    assert replaced(Fn(two_tensors), torch.rand(4, 8, 64) + 0.1, torch.rand(4, 8, 64) + 0.1, w) == {}
    # the ops on the CPU are litgpt's form, and check their shapes as the other norms' do
    r = torch.randn(4, 8, 64)
    norm = LitGPTRMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(w)
        torch.testing.assert_close(lib.op("litgpt_rms_norm")(x, w, 1e-6), norm(x), rtol=0, atol=0)
    y, h = lib.op("add_litgpt_rms_norm")(x, r, w, 1e-6)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, lib.litgpt_rmsnorm(x + r, w, 1e-6))
    with pytest.raises(fxkern.KernelInputError):
        lib.op("litgpt_rms_norm")(x, torch.randn(6, 1), 1e-6)


# ---- bias + GELU --------------------------------------------------------------------------------


class BiasAct(nn.Module):
    """A projection without bias, then bias + activation (+ residual), as fused-MLP code writes it."""

    def __init__(self, act, residual=False):
        super().__init__()
        self.proj = nn.Linear(32, 64, bias=False)
        self.bias = nn.Parameter(torch.randn(64))
        self.act, self.residual = act, residual

    def forward(self, x, r):
        h = self.act(self.proj(x) + self.bias)
        return h + r if self.residual else h


GELUS = {
    "nn.GELU": (nn.GELU, "bias_gelu"),
    "GELUActivation": (GELUActivation, "bias_gelu"),
    "F.gelu": (lambda: F.gelu, "bias_gelu"),
    "nn.GELU(tanh)": (lambda: nn.GELU(approximate="tanh"), "bias_gelu_tanh"),
    "GELUTanh": (GELUTanh, "bias_gelu_tanh"),
    "NewGELUActivation": (NewGELUActivation, "bias_gelu_new"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("act", sorted(GELUS))
def test_bias_gelu_forms(act, residual, dtype):
    make, name = GELUS[act]
    x, r = torch.randn(2, 8, 32), torch.randn(2, 8, 64)
    want = name + ("_residual" if residual else "")
    assert replaced(BiasAct(make(), residual), x, r, dtype=dtype) == {want: 1}


def test_gpt2_mlp_gelu_new_and_megatron_bias_gelu():
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    cfg = transformers.GPT2Config(n_embd=64, activation_function="gelu_new")
    assert replaced(GPT2MLP(256, cfg), torch.randn(2, 8, 64)) == {"gelu_new": 1}

    def bias_gelu(bias, y):  # Megatron-LM's fused_bias_gelu.bias_gelu, as written there
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    assert replaced(Fn(bias_gelu), torch.randn(64), torch.randn(2, 8, 64)) == {"megatron_bias_gelu": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_clip_quick_gelu_is_one_op(dtype):
    """CLIP's MLP (``fc2(quick_gelu(fc1(h)))``, transformers' ``QuickGELUActivation``): the activation,
    written ``x * torch.sigmoid(1.702 * x)``, is one op; the text model's add + LayerNorms stay as they were."""
    torch.manual_seed(0)
    cfg = transformers.CLIPTextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32)
    assert cfg.hidden_act == "quick_gelu"
    model = transformers.CLIPTextModel(cfg).to(dtype).eval()
    ids = torch.randint(0, 128, (2, 16))
    new = fxkern.apply(torch.export.export(model, (ids,)), lib.rules(), verify=True)
    assert library_calls(new) == {"quick_gelu": 2, "add_layer_norm": 4}
    other = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(new.module()(other).last_hidden_state, model(other).last_hidden_state,
                                   rtol=0, atol=0)
    torch.testing.assert_close(lib.op("quick_gelu")(ids.float()), lib.quick_gelu(ids.float()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bloom_gelu_is_one_op(dtype):
    """BLOOM's MLP activation (transformers' ``BloomGelu``, ``bloom_gelu_forward``: Megatron's GELU, its
    bias left inside ``dense_h_to_4h``): one op in the export IR and in core ATen, equal to eager to the bit."""
    from transformers.models.bloom.modeling_bloom import BloomGelu

    torch.manual_seed(0)
    one_op_in_both_irs(BloomGelu().eval(), (torch.randn(4, 8, 64).to(dtype),), "megatron_gelu")


def test_bias_gelu_near_misses_are_left_alone():
    x = torch.randn(4, 8, 64)
    # a (…, 1) "bias" broadcasts along the last axis, which the kernel's suffix indexing cannot do
    assert replaced(Fn(lambda x, b: F.gelu(x + b)), x, torch.randn(4, 8, 1)) == {}
    # quick GELU of x + b written twice: two sums (export does not merge them), where the pattern reads one
    assert replaced(Fn(lambda x, b: (x + b) * torch.sigmoid(1.702 * (x + b))), x, torch.randn(64)) == {}
    # computed once: the quick_gelu op (it has no bias form: CLIP's bias is in its nn.Linear), the add left
    # to PyTorch; with another constant, no rule
    assert replaced(Fn(lambda x, b: (lambda h: h * torch.sigmoid(1.702 * h))(x + b)), x, torch.randn(64)) == {
        "quick_gelu": 1}
    assert replaced(Fn(lambda x: x * torch.sigmoid(1.5 * x)), x) == {}
    # a plain F.gelu is one kernel already: no rule for it
    assert replaced(Fn(lambda x: F.gelu(x)), x) == {}


# ---- SwiGLU ---------------------------------------------------------------------------------------


def test_swiglu_forms():
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128)
    assert replaced(LlamaMLP(cfg), torch.randn(2, 8, 64)) == {"swiglu": 1}

    class SiLUModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.SiLU()

        def forward(self, g, u):
            return self.act(g) * u

    g, u = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    assert replaced(SiLUModule(), g, u) == {"swiglu": 1}
    assert replaced(SiLUModule(), g, u, dtype=torch.bfloat16) == {"swiglu": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_geglu_forms(dtype):
    """Gemma's MLP (transformers' GemmaMLP, gelu_pytorch_tanh; litgpt's GemmaMLP, ``F.gelu(fc_1(x),
    approximate="tanh") * fc_2(x)``) and the erf GELU as the gate's activation."""
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    cfg = transformers.GemmaConfig(hidden_size=64, intermediate_size=128)
    assert cfg.hidden_act == "gelu_pytorch_tanh"
    assert replaced(GemmaMLP(cfg), torch.randn(2, 8, 64), dtype=dtype) == {"geglu_tanh": 1}

    class LitGemmaMLP(nn.Module):
        def __init__(self, approximate):
            super().__init__()
            self.fc_1, self.fc_2, self.proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
            self.approximate = approximate

        def forward(self, x):
            return self.proj(F.gelu(self.fc_1(x), approximate=self.approximate) * self.fc_2(x))

    x = torch.randn(2, 8, 64)
    assert replaced(LitGemmaMLP("tanh"), x, dtype=dtype) == {"geglu_tanh": 1}
    assert replaced(LitGemmaMLP("none"), x, dtype=dtype) == {"geglu": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_gpt_oss_expert_gate_is_one_op(dtype):
    """GPT-OSS's expert gate, transformers' own ``GptOssExperts._apply_gate``: the interleaved columns'
    clamps, the sloped SiLU and the shifted up are one op in the export IR and in core ATen, equal to
    eager to the bit; not quick_gelu (``gate * sigmoid(gate * 1.702)``) and four more kernels."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(transformers.GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=4))
    assert (experts.alpha, experts.limit) == (1.702, 7.0)
    torch.manual_seed(0)
    gate_up = (6 * torch.randn(24, 96)).to(dtype)  # (tokens, 2 * intermediate), out past both clamps
    one_op_in_both_irs(experts._apply_gate, (gate_up,), "clamped_swiglu")
    # a transposed projection is not contiguous, which the rule's filter asks (the op would copy it first):
    # left to the smaller rule, as before
    assert replaced(Fn(lambda x: experts._apply_gate(x.t())), gate_up.t().contiguous(), dtype=dtype) == {
        "quick_gelu": 1}
    with pytest.raises(fxkern.KernelInputError, match=r"gate_up has shape \(24, 95\): give it an even last axis"):
        lib.op("clamped_swiglu")(gate_up[:, :95], 1.702, 7.0, -7.0, 7.0)


def test_gemma_model_is_replaced_end_to_end():
    """A tiny GemmaForCausalLM: its norms, rotary embeddings and GEGLU MLPs all become library ops."""
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64)
    model = transformers.GemmaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    new = fxkern.apply(ep, lib.rules(), verify=True)
    targets = [n.target for n in new.graph.nodes]
    assert targets.count(lib.op("geglu_tanh").default) == 2
    # queries rotated; keys (2 heads for 4 query heads) rotated and repeated in one kernel; values repeated
    for name in ("rotary_embedding", "rotary_embedding_repeat_kv", "repeat_kv"):
        assert targets.count(lib.op(name).default) == 2
    assert targets.count(lib.op("add_gemma_rms_norm").default) + targets.count(lib.op("gemma_rms_norm").default) == 5
    other = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(new.module()(other, use_cache=False).logits, model(other, use_cache=False).logits)


def test_t5_gated_gelu_new_is_one_op_not_gelu_new_and_a_mul():
    """T5 v1.1 / Flan-T5's ``T5DenseGatedActDense``: ``gelu_new(wi_0(h)) * wi_1(h)``. The gated rule
    wins over the plain ``gelu_new`` rule, which would leave the product to another pass."""
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    cfg = transformers.T5Config(d_model=64, d_ff=128, feed_forward_proj="gated-gelu", dropout_rate=0.0)
    assert cfg.dense_act_fn == "gelu_new" and cfg.is_gated_act
    x = torch.randn(2, 8, 64)
    assert replaced(T5DenseGatedActDense(cfg), x) == {"geglu_new": 1}
    assert replaced(T5DenseGatedActDense(cfg), x, dtype=torch.bfloat16) == {"geglu_new": 1}

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu")
    encoder = transformers.T5EncoderModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    new = fxkern.apply(torch.export.export(encoder, (ids,)), lib.rules(), verify=True)
    targets = [n.target for n in new.graph.nodes]
    assert targets.count(lib.op("geglu_new").default) == 2 and lib.op("gelu_new").default not in targets
    with torch.no_grad():
        torch.testing.assert_close(new.module()(ids).last_hidden_state, encoder(ids).last_hidden_state)


def test_chunked_swiglu_reads_the_halves_in_place():
    def chunked(x):
        a, b = x.chunk(2, -1)
        return F.silu(a) * b

    ep = torch.export.export(Fn(chunked), (torch.randn(2, 8, 128),))
    report = fxkern.explain(ep, lib.rules())
    # the plain kernel would need contiguous copies of the halves: it declines them ...
    assert not report["swiglu"].matches
    assert any("filter" in m.reason for m in report["swiglu"].near_misses)
    # ... and the chunked kernel takes x itself
    assert len(report["swiglu_chunked"].matches) == 1


class DiffusersGLU(nn.Module):
    """diffusers' ``GEGLU`` / ``SwiGLU`` (diffusers 0.42 ``models/activations.py``), as written there."""

    def __init__(self, act):
        super().__init__()
        self.proj = nn.Linear(64, 2 * 48)
        self.act = act

    def forward(self, hidden_states):
        hidden_states = self.proj(hidden_states)
        hidden_states, gate = hidden_states.chunk(2, dim=-1)
        return hidden_states * self.act(gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_chunked_glu_forms(dtype):
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    x = torch.randn(2, 8, 64)
    phi3 = Phi3MLP(transformers.Phi3Config(hidden_size=64, intermediate_size=96))
    assert replaced(phi3, x, dtype=dtype) == {"swiglu_chunked": 1}
    assert replaced(DiffusersGLU(nn.SiLU()), x, dtype=dtype) == {"swiglu_chunked_gate_last": 1}
    assert replaced(DiffusersGLU(F.gelu), x, dtype=dtype) == {"geglu_chunked": 1}


def test_chunked_glu_near_misses_and_checks():
    def rows_split(x):  # halves of another axis
        a, b = x.chunk(2, 1)
        return F.silu(a) * b

    def tanh_gelu(x):  # GEGLU's kernel is the erf GELU
        h, gate = x.chunk(2, -1)
        return h * F.gelu(gate, approximate="tanh")

    assert replaced(Fn(rows_split), torch.randn(4, 6, 32)) == {}
    assert replaced(Fn(tanh_gelu), torch.randn(4, 32)) == {}
    with pytest.raises(fxkern.KernelInputError, match="two equal halves; x has shape \\(3, 7\\)"):
        lib.op("swiglu_chunked")(torch.randn(3, 7))


# ---- softmax --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_softmax_forms(dtype):
    x = torch.randn(2, 4, 8, 16)
    forms = [
        lambda x: F.softmax(x, dim=-1),
        lambda x: x.softmax(-1),
        lambda x: torch.softmax(x, -1),
        nn.Softmax(dim=-1),  # wrapped: apply() on a program whose input is named `input` trips a
    ]                        # placeholder-rename bug in fxkern.rewrite (reported separately)
    for form in forms:
        assert replaced(Fn(form), x, dtype=dtype) == {"softmax": 1}
    hf = Fn(lambda w: F.softmax(w, dim=-1, dtype=torch.float32).to(w.dtype))
    assert replaced(hf, x, dtype=dtype) == {"softmax": 1}


def test_softmax_over_other_axes_is_left_alone():
    x = torch.randn(4, 8, 16)
    assert replaced(Fn(lambda x: F.softmax(x, dim=0)), x) == {}
    assert replaced(Fn(lambda x: F.softmax(x, dim=1)), x) == {}
    assert replaced(Fn(lambda x: F.log_softmax(x, dim=-1)), x) == {}


class Scores(nn.Module):
    """Attention's scores from q and k, scaled (``* scaling`` or ``/ sqrt(d)``), masked and softmaxed,
    as transformers' eager attention writes it (``float32``: Llama's softmax cast back)."""

    def __init__(self, divide=False, float32=False):
        super().__init__()
        self.divide, self.float32 = divide, float32

    def forward(self, q, k, mask):
        w = torch.matmul(q, k.transpose(2, 3))
        w = w / math.sqrt(q.shape[-1]) if self.divide else w * q.shape[-1] ** -0.5
        w = w + mask
        if self.float32:
            return F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return F.softmax(w, dim=-1)


def causal(b, s, dtype=torch.float32):
    """transformers' 4-d causal mask, (b, 1, s, s), finfo.min above the diagonal."""
    return torch.full((s, s), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None].expand(b, 1, s, s).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("divide", [False, True], ids=["scaled", "divided"])
@pytest.mark.parametrize("float32", [False, True], ids=["plain", "float32"])
def test_scaled_masked_softmax_forms(dtype, divide, float32):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    name = f"{'divided' if divide else 'scaled'}_masked_softmax"  # the float32 form runs the same op
    pad = torch.zeros(2, 1, 1, 16)
    pad[1, ..., 12:] = torch.finfo(dtype).min  # BERT's padding mask, (b, 1, 1, s)
    for mask in (causal(2, 16), causal(1, 16), pad, torch.randn(2, 4, 16, 16)):
        assert replaced(Scores(divide, float32), q, k, mask, dtype=dtype) == {name: 1}


class SoftcappedScores(torch.nn.Module):
    """transformers' Gemma 2 eager attention scores: scaled, soft-capped, masked, float32 softmax
    (``uncap``: what multiplies tanh's output, the cap unless a test says otherwise)."""

    def __init__(self, cap=50.0, float32=True, uncap=None):
        super().__init__()
        self.cap, self.float32, self.uncap = cap, float32, cap if uncap is None else uncap

    def forward(self, q, k, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.0625
        w = w / self.cap
        w = torch.tanh(w)
        w = w * self.uncap
        w = w + mask
        if self.float32:
            return F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return F.softmax(w, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("float32", [False, True], ids=["plain", "float32"])
def test_softcapped_masked_softmax_forms(dtype, float32):
    """The scale, cap, tanh and mask go into one kernel with the softmax. A tanh multiplied by another
    number than the one it was divided by is not a soft cap: the scaled, masked rule takes the
    softmax then, with that number as its scale, and the rest stays with PyTorch."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8) * 30, torch.randn(2, 4, 16, 8) * 30  # scores past the cap
    for mask in (causal(2, 16, dtype), torch.randn(2, 4, 16, 16)):
        assert replaced(SoftcappedScores(float32=float32), q, k, mask, dtype=dtype) == {"softcapped_masked_softmax": 1}
        assert replaced(SoftcappedScores(float32=float32, uncap=30.0), q, k, mask, dtype=dtype) == {
            "scaled_masked_softmax": 1}


def test_softcapped_masked_softmax_op_computes_the_cap_and_names_itself_in_errors():
    from fxkern.library import softmax as sm

    x, mask = torch.randn(2, 3, 8, 16) * 200, torch.zeros(1, 1, 8, 16)
    mask[..., 10:] = torch.finfo(torch.float32).min
    op = lib.op("softcapped_masked_softmax")
    capped = op(x, mask, 0.0625, 5.0)
    exact = F.softmax(5.0 * torch.tanh(x.double() * 0.0625 / 5.0) + mask.double(), dim=-1)
    torch.testing.assert_close(capped, exact.float(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(capped, sm.scaled_masked_softmax(x, mask, 0.0625))  # the cap changed the scores
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::softcapped_masked_softmax: .*must both be 4-d"):
        op(x, torch.zeros(8, 16), 0.0625, 5.0)
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::divided_masked_softmax: .*mask\[None, None\]"):
        lib.op("divided_masked_softmax")(x, torch.zeros(8, 16), 3.0)


class SinkScores(nn.Module):
    """transformers' GPT-OSS eager attention scores: scaled, masked, a learned sink logit a head
    concatenated to every row, the row's max subtracted, a softmax in the scores' dtype, the sinks'
    column dropped (``use_indices``: the max's indices read too)."""

    def __init__(self, heads=4, use_indices=False):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads))
        self.use_indices = use_indices

    def forward(self, q, k, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([w, sinks], dim=-1)
        top = combined.max(dim=-1, keepdim=True)
        probs = F.softmax(combined - top.values, dim=-1, dtype=combined.dtype)[..., :-1]
        return probs * top.indices if self.use_indices else probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_gpt_oss_sink_softmax(dtype):
    """The scale, mask, sinks, max and softmax in one op, whose result is the kept columns, in each
    mask shape the kernel reads; the max's unread indices go with it. Read indices keep the max (and
    so the match) with PyTorch."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    for mask in (causal(2, 16, dtype), causal(1, 16, dtype), torch.randn(2, 4, 16, 16)):
        assert replaced(SinkScores(), q, k, mask, dtype=dtype) == {"sink_masked_softmax": 1}
    assert "sink_masked_softmax" not in replaced(SinkScores(use_indices=True), q, k, causal(2, 16, dtype), dtype=dtype)
    # core ATen: the reshape a view, the softmax _softmax
    ep = torch.export.export(SinkScores().to(dtype), (q.to(dtype), k.to(dtype), causal(2, 16, dtype)))
    new = fxkern.apply(ep.run_decompositions(), lib.rules(), ir="core_aten", verify=True)
    assert library_calls(new) == {"sink_masked_softmax": 1}


def test_sink_op_is_its_pattern_and_checks_its_sinks():
    x, mask, sinks = torch.randn(2, 3, 5, 7), torch.zeros(2, 1, 5, 7), torch.randn(3)
    mask[..., 4:] = torch.finfo(torch.float32).min
    op = lib.op("sink_masked_softmax")
    got = op(x, mask, sinks, 0.125, 2, 5)
    scores = torch.cat([x.double() * 0.125 + mask.double(), sinks.double().view(1, 3, 1, 1).expand(2, 3, 5, 1)], -1)
    torch.testing.assert_close(got, F.softmax(scores, dim=-1)[..., :-1].float(), rtol=1e-5, atol=1e-7)
    assert float(got.sum(-1).max()) < 1  # the sinks took a share of every row
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::sink_masked_softmax: sinks \(4,\).*one value a head"):
        op(x, mask, torch.randn(4), 0.125, 2, 5)
    with pytest.raises(fxkern.KernelInputError, match=r"batch=3, queries=5 must be the scores'"):
        op(x, mask, sinks, 0.125, 3, 5)
    with pytest.raises(fxkern.KernelInputError, match=r"must both be 4-d"):
        op(x, torch.zeros(5, 7), sinks, 0.125, 2, 5)


def test_masked_softmax_near_misses_take_the_plain_softmax():
    """Masks the kernel does not read (not 4-d, another dtype, one that broadcasts the key axis) leave
    the scale and the add to PyTorch; the softmax alone is still replaced."""
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    for mask in (causal(1, 16)[0, 0], causal(2, 16)[:, :, :, :1]):
        assert replaced(Scores(), q, k, mask) == {"softmax": 1}
    module = Scores(float32=True).to(torch.bfloat16)
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    ep = torch.export.export(module, (qb, kb, causal(2, 16)))  # a float32 mask: the add promotes to float32
    report = fxkern.explain(ep, lib.rules())
    assert not report["scaled_masked_softmax_float32"].matches


def test_masked_softmax_op_checks_its_shapes_and_reads_expanded_masks_in_place(rules):
    from fxkern.library import softmax as sm

    x = torch.randn(2, 4, 16, 32)
    op = lib.op("scaled_masked_softmax")
    with pytest.raises(fxkern.KernelInputError, match=r"must both be 4-d.*mask\[None, None\]"):
        op(x, torch.zeros(16, 32), 0.5)
    with pytest.raises(fxkern.KernelInputError, match="does not broadcast onto scores"):
        op(x, torch.zeros(2, 2, 16, 32), 0.5)
    with pytest.raises(fxkern.KernelInputError, match="does not broadcast onto scores"):
        op(x, torch.zeros(2, 1, 16, 1), 0.5)
    with pytest.raises(fxkern.KernelInputError, match="give the mask the scores' dtype"):
        op(x, torch.zeros(2, 1, 16, 32, dtype=torch.float64), 0.5)
    mask = causal(1, 16).expand(2, 4, 16, 16)
    assert sm._compact(mask).shape == (1, 1, 16, 16) and sm._compact(mask).is_contiguous()
    assert sm._compact(mask[:, :, :, :8]).shape == (1, 1, 16, 8)  # still strided: the op copies it
    torch.testing.assert_close(op(x[..., :16], mask, 0.5), F.softmax(x[..., :16] * 0.5 + mask, -1))
    torch.testing.assert_close(lib.op("divided_masked_softmax")(x, torch.zeros(1, 1, 1, 32), 3.0),
                               F.softmax(x / 3.0, -1))
    # the masked ops run softmax's grids; a misaligned mask keeps them off the 16-byte small blocks
    assert sm._grid(x, torch.zeros(1, 1, 16, 32)) == "_short_32bit"
    assert sm._grid(x, torch.zeros(1, 1, 16, 33)[..., 1:]) == "_short_32bit"  # copied to an aligned buffer
    assert sm._grid(x, torch.zeros(16 * 32 + 1)[1:].view(1, 1, 16, 32)) == "_32bit"
    # rows of up to 2048 elements: the masked ops' 4-pack small blocks (16-bit one-warp ones up to 1024,
    # two-warp ones up to 2048, float32 four-warp ones past 1024); the plain softmax keeps the 8-pack ones
    every = tuple(sm.NARROW_GRIDS)
    half = torch.zeros(2, 4, 16, 1024, dtype=torch.bfloat16)
    assert sm._grid(half, half[:1, :1], narrow=every) == "_short_4packs"
    assert sm._grid(torch.zeros(1, 1, 2, 1032, dtype=torch.float16), narrow=every) == "_4packs_2048"
    assert sm._grid(torch.zeros(1, 1, 2, 2048, dtype=torch.bfloat16), narrow=every) == "_4packs_2048"
    assert sm._grid(torch.zeros(1, 1, 2, 2048, dtype=torch.float16)) == "_short"
    assert sm._grid(torch.zeros(1, 1, 2, 2048, dtype=torch.float16), narrow=("_short_4packs",)) == "_short"
    assert sm._grid(torch.zeros(1, 1, 2, 2048, dtype=torch.float16), narrow=every) == "_4packs_2048"
    assert sm._grid(torch.zeros(1, 1, 2, 2056, dtype=torch.bfloat16), narrow=every) == ""
    assert sm._grid(torch.zeros(1, 1, 2, 1024), narrow=every) == "_short_32bit"
    assert sm._grid(torch.zeros(1, 1, 2, 1028), narrow=every) == "_4packs_2048_32bit"
    assert sm._grid(torch.zeros(1, 1, 2, 2048), torch.zeros(1, 1, 2, 2048), narrow=every) == "_4packs_2048_32bit"
    assert sm._grid(torch.zeros(1, 1, 2, 2048)) == "_32bit"
    assert sm._grid(torch.zeros(1, 1, 2, 2052), narrow=every) == "_32bit"
    assert sm._grid(torch.zeros(1, 1, 2, 2046), narrow=every) == "_32bit"  # not whole packs
    assert sm._grid(torch.zeros(2 * 2048 + 1)[1:].view(1, 1, 2, 2048), narrow=every) == "_32bit"  # misaligned
    assert sm._grid(half) == "_short" and sm.grid_for(half) == sm.ROWS + "_short"
    # the 4-pack grids hold every 16-bit row the one-warp 8-pack blocks took, so the masked ops leave those out
    base = {"", "_32bit", "_short_32bit", *every}
    assert set(sm.SOFTCAPPED_MASKED_GRIDS) == base | {s + sm.EDGES for s in base}
    assert set(sm.SCALED_MASKED_GRIDS) == base | {s + sm.EDGES for s in base} | {sm.LONG}
    assert "_short" in sm._grids(sm.SCALED_MASKED_SOFTMAX, blocks_narrow=28, narrow=("_short_4packs",))
    assert "_short" in sm._grids(sm.SCALED_MASKED_SOFTMAX) and "_short_4packs" not in sm._grids(sm.SCALED_MASKED_SOFTMAX)
    with pytest.raises(ValueError, match="multiple of 4"):
        sm._grids(sm.SCALED_MASKED_SOFTMAX, blocks_narrow=30)
    # each holds a row of its longest length a block, 896 threads an SM, and fetches a row before its values;
    # rows of more than a warp reduce their max and sum apart (FXK_TWO_REDUCTIONS 2, _G the block's threads);
    # the macros come before the source's own defaults (#ifndef), so they are the ones compiled
    for suffix, (threads, blocks) in {"_short_4packs": (32, 28), "_4packs_2048": (64, 14),
                                      "_4packs_2048_32bit": (128, 7)}.items():
        for grids, spec in ((sm.SCALED_MASKED_GRIDS, sm.SCALED_MASKED_SOFTMAX),
                            (sm.SOFTCAPPED_MASKED_GRIDS, sm.SOFTCAPPED_MASKED_SOFTMAX)):
            source, size = grids[suffix].kernel_source, "F32" if suffix.endswith("_32bit") else "HALF"
            assert source.endswith(spec.kernel_source), suffix
            prefix = source[:len(source) - len(spec.kernel_source)]
            assert set(prefix.splitlines()) == {f"#define ROW_THREADS {threads}", f"#define FXK_ROW_PACKS_{size} 4",
                                                f"#define FXK_ROW_BLOCKS_{size} {blocks}",
                                                "#define FXK_MASK_FETCH_FIRST 1",
                                                *(["#define FXK_TWO_REDUCTIONS 2",
                                                   f"#define FXK_TWO_REDUCTIONS_G {threads}"] if threads > 32 else [])
                                                }, suffix
            op = fxkern.kernel_op((sm.MASKED_ROWS if grids is sm.SCALED_MASKED_GRIDS else sm.SOFTCAPPED_ROWS) + suffix)
            (grid_x, *_) = [symbolic.compile_expr(g) for g in op.plan.grid]
            scores = (2, 16, 2048, 2048)
            assert op.plan.block[0] == threads, suffix
            steps = sm.MASKED_TUNING["steps"].get(suffix, 1)  # register-fulls a block takes one after another
            assert grid_x(([scores, (2, 1, 2048, 2048)], [scores])) == \
                2 * 16 * 2048 * 2048 // (sm.NARROW_GRIDS[suffix][1] * steps), suffix
    # the op's CUDA path picks among the grids it has: the 4-pack ones by their suffixes, the rest by _grid
    picked = []
    on_cuda = sm._masked_on_cuda({s: (lambda s: lambda *a: picked.append(s))(s)
                                  for s in ("", "_32bit", "_short_32bit", "_short_4packs", "_4packs_2048")}, "op")
    for d, dtype in ((512, torch.bfloat16), (2048, torch.bfloat16), (2048, torch.float32), (512, torch.float32)):
        on_cuda(torch.zeros(1, 2, 3, d, dtype=dtype), torch.zeros(1, 1, 3, d, dtype=dtype), 0.5)
    assert picked == ["_short_4packs", "_4packs_2048", "_32bit", "_short_32bit"]
    assert "_short_4packs" not in sm.SOFTMAX_GRIDS


def test_masked_softmax_fetches_long_rows_first_and_the_others_keep_their_grids():
    """The scaled, masked kernel's rows past 2048 keys (8192 keys in the pieces fxkern.split cuts)
    fetch a row's scores and mask before making their values: 16-bit ones in whole packs in their own
    grid (LONG) at 2 blocks an SM, float32 ones in "_32bit". 16-bit rows not in whole packs (an odd
    length) take the EDGES kernel of the "" grid, not LONG; the "" grid stays the spec's own (TensorRT
    plugins carry it). The sink kernel takes the same grids (benchmarks/sink_tuning.py); the soft-capped one
    keeps its own and never picks LONG."""
    from fxkern.library import softmax as sm

    def prefix(grid, spec):
        assert grid.kernel_source.endswith(spec.kernel_source)
        return set(grid.kernel_source[:len(grid.kernel_source) - len(spec.kernel_source)].splitlines())

    masked = sm.SCALED_MASKED_GRIDS
    assert prefix(masked[sm.LONG], sm.SCALED_MASKED_SOFTMAX) == {"#define FXK_MASK_FETCH_FIRST 1",
                                                                "#define FXK_ROW_BLOCKS_HALF 2"}
    assert masked[sm.LONG].geometry == sm.SCALED_MASKED_SOFTMAX.geometry
    assert prefix(masked["_32bit"], sm.SCALED_MASKED_SOFTMAX) == {"#define FXK_MASK_FETCH_FIRST 1",
                                                                 "#define FXK_ROW_BLOCKS_F32 2"}
    for grids, spec in ((masked, sm.SCALED_MASKED_SOFTMAX), (sm.SOFTCAPPED_MASKED_GRIDS, sm.SOFTCAPPED_MASKED_SOFTMAX),
                        (sm.SINK_MASKED_GRIDS, sm.SINK_MASKED_SOFTMAX), (sm.SOFTMAX_GRIDS, sm.SOFTMAX)):
        assert grids[""] is spec
    # the sink kernel takes the masked kernel's tuning (its long rows fetched first); the soft-capped one not
    assert sm.LONG not in sm.SOFTCAPPED_MASKED_GRIDS
    sink = sm.SINK_MASKED_GRIDS
    assert prefix(sink[sm.LONG], sm.SINK_MASKED_SOFTMAX) == prefix(masked[sm.LONG], sm.SCALED_MASKED_SOFTMAX)
    assert prefix(sink["_32bit"], sm.SINK_MASKED_SOFTMAX) == prefix(masked["_32bit"], sm.SCALED_MASKED_SOFTMAX)
    assert set(sink) == set(masked)

    extra = sm._extra_grids(masked)
    assert set(extra) == {*sm.NARROW_GRIDS, sm.LONG} | {s for s in masked if s.endswith(sm.EDGES)}
    assert sm.LONG not in sm._extra_grids(sm.SOFTCAPPED_MASKED_GRIDS)
    bf16 = dict(dtype=torch.bfloat16)
    for d, want in ((8192, sm.LONG), (2056, sm.LONG), (16384, sm.LONG), (40000, sm.LONG), (2048, "_4packs_2048"),
                    (8190, sm.EDGES), (2049, sm.EDGES)):  # not whole packs: ""'s EDGES kernel
        assert sm._grid(torch.zeros(1, 2, 3, d, **bf16), torch.zeros(1, 1, 3, d, **bf16), narrow=extra) == want, d
    misaligned = torch.zeros(3 * 8192 + 1, **bf16)[1:].view(1, 1, 3, 8192)
    assert sm._grid(torch.zeros(1, 2, 3, 8192, **bf16), misaligned, narrow=extra) == sm.EDGES  # its mask shifted
    assert sm._grid(torch.zeros(1, 2, 3, 8192, **bf16), narrow=tuple(sm.NARROW_GRIDS)) == ""  # an op without it
    assert sm._grid(torch.zeros(1, 2, 3, 8192), torch.zeros(1, 1, 3, 8192), narrow=extra) == "_32bit"
    # the op's CUDA path hands a long 16-bit row to LONG, an odd one to ""'s EDGES kernel
    for grids in (masked, sm.SINK_MASKED_GRIDS):
        picked = []
        on_cuda = sm._masked_on_cuda({s: (lambda s: lambda *a: picked.append(s))(s) for s in grids}, "op")
        for d in (8192, 8191):
            on_cuda(torch.zeros(1, 2, 3, d, **bf16), torch.zeros(1, 1, 3, d, **bf16), 0.5)
        assert picked == [sm.LONG, sm.EDGES]



def test_rows_not_in_whole_packs_take_the_edges_kernels():
    """Rows of an odd length (a prompt of 1001 tokens) or a mask off a 16-byte boundary run in each grid's
    EDGES kernel: the grid's own source and geometry with FXK_EDGES, which reads a row in the aligned packs
    around it. _grid picks it by the row's span (a pack less one element more) where the op has it and the
    row fits; scores off a 16-byte boundary (whose output, allocated aligned, would not share their phase),
    rows too long for registers and ops without EDGES grids keep the scalar path in "" or "_32bit"."""
    from fxkern.library import softmax as sm

    for grids in (sm.SCALED_MASKED_GRIDS, sm.SOFTCAPPED_MASKED_GRIDS, sm.SINK_MASKED_GRIDS, sm.SOFTMAX_GRIDS):
        assert sm.LONG + sm.EDGES not in grids
        for suffix, grid in grids.items():
            if suffix == sm.LONG or suffix.endswith(sm.EDGES):
                continue
            edges = grids[suffix + sm.EDGES]
            unfetched = edges.kernel_source.replace("#define FXK_MASK_FETCH_FIRST 1\n", "")
            assert unfetched == "#define FXK_EDGES 1\n" + grid.kernel_source.replace(
                "#define FXK_MASK_FETCH_FIRST 1\n", ""), suffix
            assert edges.geometry == grid.geometry and edges.kernel_name == grid.kernel_name, suffix
    assert all("FXK_EDGES 1" not in g.kernel_source for s, g in sm.SCALED_MASKED_GRIDS.items() if not s.endswith(sm.EDGES))
    # an EDGES kernel fetches first as its grid does, unless edges_fetch_first names others: the masked
    # kernels' 16-bit small blocks make values as loads arrive, their float32 ones fetch first
    fetch = "#define FXK_MASK_FETCH_FIRST 1"
    fetched = {s + sm.EDGES for s in ("_short_32bit", "_4packs_2048_32bit", "_32bit")}
    for grids in (sm.SCALED_MASKED_GRIDS, sm.SOFTCAPPED_MASKED_GRIDS, sm.SINK_MASKED_GRIDS):
        assert {s for s, g in grids.items() if s.endswith(sm.EDGES) and fetch in g.kernel_source} == fetched
        assert fetch not in grids["_short_4packs" + sm.EDGES].kernel_source
        assert fetch in grids["_short_4packs"].kernel_source
    default = sm._grids(sm.SINK_MASKED_SOFTMAX, **{**sm.MASKED_LONG_TUNING, "edges_fetch_first": None})
    for suffix, grid in default.items():  # without edges_fetch_first, each EDGES kernel as its grid
        if suffix.endswith(sm.EDGES):
            assert (fetch in grid.kernel_source) == (fetch in default[suffix[:-len(sm.EDGES)]].kernel_source)
    assert fetch in sm.SCALED_MASKED_GRIDS["_short_4packs"].kernel_source
    apart = sm._grids(sm.SCALED_MASKED_SOFTMAX, **{**sm.MASKED_LONG_TUNING, "edges_fetch_first": ("_32bit",)})
    assert {s for s, g in apart.items() if s.endswith(sm.EDGES) and fetch in g.kernel_source} == {"_32bit" + sm.EDGES}
    assert all(apart[s].kernel_source == g.kernel_source for s, g in sm.SCALED_MASKED_GRIDS.items()
               if not s.endswith(sm.EDGES))

    extra = sm._extra_grids(sm.SCALED_MASKED_GRIDS)
    f32, bf16 = dict(dtype=torch.float32), dict(dtype=torch.bfloat16)
    cases = [(f32, 1001, "_short_32bit"), (f32, 1021, "_short_32bit"), (f32, 1022, "_4packs_2048_32bit"),
             (f32, 2045, "_4packs_2048_32bit"), (f32, 2046, "_32bit"), (f32, 4001, "_32bit"), (f32, 8189, "_32bit"),
             (bf16, 7, "_short_4packs"), (bf16, 1001, "_short_4packs"), (bf16, 1017, "_short_4packs"),
             (bf16, 1018, "_4packs_2048"), (bf16, 2041, "_4packs_2048"), (bf16, 2042, ""), (bf16, 4001, ""),
             (bf16, 16377, "")]
    for dtype, d, base in cases:
        x, mask = torch.zeros(1, 2, 3, d, **dtype), torch.zeros(1, 1, 3, d, **dtype)
        assert sm._grid(x, mask, narrow=extra) == base + sm.EDGES, (dtype, d)
        assert sm._grid(x, mask, narrow=tuple(sm.NARROW_GRIDS)) == ("_32bit" if x.element_size() == 4 else ""), d
    # too long for a block's registers: the scalar path's grids
    assert sm._grid(torch.zeros(1, 1, 1, 8190), narrow=extra) == "_32bit"
    assert sm._grid(torch.zeros(1, 1, 1, 16378, **bf16), narrow=extra) == ""
    # scores off a 16-byte boundary: the scalar path
    shifted = torch.zeros(3 * 1001 + 1, **bf16)[1:].view(1, 1, 3, 1001)
    assert sm._grid(shifted, torch.zeros(1, 1, 3, 1001, **bf16), narrow=extra) == ""
    # rows in whole packs and a mask off a boundary: the grid for their span, its mask shifted in registers
    mask = torch.zeros(3 * 1024 + 1, **bf16)[1:].view(1, 1, 3, 1024)
    assert sm._grid(torch.zeros(1, 2, 3, 1024, **bf16), mask, narrow=extra) == "_4packs_2048" + sm.EDGES
    # the plain softmax: its own small blocks
    assert sm.grid_for(torch.zeros(4, 1001, **bf16)) == sm.ROWS + "_short" + sm.EDGES
    assert sm.grid_for(torch.zeros(4, 1001)) == sm.ROWS + "_short_32bit" + sm.EDGES
    assert sm.grid_for(torch.zeros(4, 5001)) == sm.ROWS + "_32bit" + sm.EDGES
    assert sm.grid_for(torch.zeros(4, 1024, **bf16)) == sm.ROWS + "_short"
    # dtypes the kernels do not take reach the op's own check, not a KeyError here (a review found one)
    for dtype in (torch.float64, torch.float8_e4m3fn):
        assert sm._grid(torch.zeros(1, 2, 3, 7, dtype=dtype), narrow=extra) == ""
        assert sm.grid_for(torch.zeros(2, 7, dtype=dtype)) == sm.ROWS
    # every op's CUDA path reaches them
    for grids in (sm.SCALED_MASKED_GRIDS, sm.SOFTCAPPED_MASKED_GRIDS, sm.SINK_MASKED_GRIDS):
        picked = []
        on_cuda = sm._masked_on_cuda({s: (lambda s: lambda *a: picked.append(s))(s) for s in grids}, "op")
        on_cuda(torch.zeros(1, 2, 3, 1001, **bf16), torch.zeros(1, 1, 3, 1001, **bf16), 0.5)
        assert picked == ["_short_4packs" + sm.EDGES]


def test_masked_ops_check_a_mask_before_narrowing_its_broadcast_axes():
    """An expanded mask is narrowed to the (mB, mH, mQ, D) tensor the kernel broadcasts, but only one
    that broadcasts onto the scores: a (3, ...) mask on (2, ...) scores is refused, as eager refuses it,
    before any kernel runs (a review found it narrowed first, and so computed an answer)."""
    from fxkern.errors import KernelInputError
    from fxkern.library import softmax as sm

    ran = []
    on_cuda = sm._masked_on_cuda({s: lambda *a: ran.append(a) for s in ("", "_32bit", "_short_32bit")}, "fxkern_lib::op")
    x = torch.zeros(2, 4, 8, 16)
    with pytest.raises(KernelInputError, match="fxkern_lib::op: .*mask"):
        on_cuda(x, torch.zeros(1, 4, 8, 16).expand(3, 4, 8, 16), 0.5)
    assert not ran
    on_cuda(x, torch.zeros(1, 1, 8, 16).expand(2, 4, 8, 16), 0.5)  # one that broadcasts: narrowed to (1, 1, 8, 16)
    assert ran[0][1].shape == (1, 1, 8, 16)


def test_divided_masked_op_multiplies_by_the_float32_reciprocal():
    """PyTorch's CUDA division by a Python number multiplies by float32(1 / float32(divisor)); the op
    passes that scale, inf for a zero divisor (x / 0.0 is not an error in eager)."""
    from fxkern.library import softmax as sm

    scales = []
    divided = sm._divided_masked_on_cuda(lambda x, mask, scale: scales.append(scale))
    for divisor in (11.0, 0.0, -0.0, 1e-46):
        divided(None, None, divisor)
    assert scales[0] == 1.0 / sm._f32(11.0) and scales[1:] == [math.inf, -math.inf, math.inf]


class T5Scores(nn.Module):
    """transformers 4.x ``T5Attention.forward`` from the scores to the attention weights, as written there:
    no scaling, the mask added into the relative position bias, ``scores += position_bias_masked``, a
    float32 softmax cast back with ``type_as`` (``in_place=False``: the same written ``scores = scores +
    ...``, as the IRs that ``run_decompositions()`` makes hold it)."""

    def __init__(self, in_place=True):
        super().__init__()
        self.in_place = in_place

    def forward(self, query_states, key_states, position_bias, mask=None):
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        if mask is not None:
            causal_mask = mask[:, :, :, : key_states.shape[-2]]
            position_bias = position_bias + causal_mask
        position_bias_masked = position_bias
        if self.in_place:
            scores += position_bias_masked
        else:
            scores = scores + position_bias_masked
        return nn.functional.softmax(scores.float(), dim=-1).type_as(scores)


def _matched_rules(program):
    return sorted(m.rule for m in fxkern.explain(program, lib.rules()).matches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
def test_t5_attention_softmax(dtype, in_place):
    """T5's unscaled scores plus its (1, H, Q, K) position bias, or (B, H, Q, K) with the padding mask
    added in: the bias add and the float32 softmax are one unscaled masked softmax (the scaled kernel at
    a scale of 1). The export IR keeps ``scores += ...`` as an in-place ``add_`` on the matmul's
    result, which nothing else reads: the match takes it as the add. In core ATen the in-place add
    comes back as an add between two views of the matmul's output, which no pattern crosses (the
    matcher takes only views that keep the shape): there the softmax and its two casts are one op
    (``t5_softmax``), where the plain softmax rule took the softmax and left the casts."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    bias = torch.randn(1, 4, 16, 16)
    pad = torch.zeros(2, 1, 1, 16)
    pad[1, ..., 12:] = torch.finfo(dtype).min
    for args in ((q, k, bias), (q, k, bias, pad)):
        model = T5Scores(in_place)
        assert replaced(model, *args, dtype=dtype) == {"masked_softmax": 1}
        typed = tuple(a.to(dtype) for a in args)
        ep = torch.export.export(model.to(dtype), typed)
        assert _matched_rules(ep) == ["t5_masked_softmax"]
        core = ep.run_decompositions()
        assert _matched_rules(core) == ["t5_softmax" if in_place else "t5_masked_softmax"]
        new = fxkern.apply(core, lib.rules(), verify=True)
        torch.testing.assert_close(new.module()(*typed), model(*typed), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_t5_softmax_alone_and_unscaled_masked_scores(dtype):
    """T5's ``softmax(x.float(), dim=-1).type_as(x)`` is one op with its casts (``softmax_float32`` is
    transformers' other float32 form, ``dtype=torch.float32`` then ``.to()``). Scores plus a mask,
    unscaled, in a softmax of their dtype are the unscaled masked op; scaled scores stay with the scaled
    op, which wins that overlap (added first)."""
    x, mask = torch.randn(2, 4, 16, 16), causal(2, 16)
    ep = torch.export.export(Fn(lambda s: F.softmax(s.float(), dim=-1).type_as(s)), (x.to(dtype),))
    assert _matched_rules(ep) == ["t5_softmax"]
    assert replaced(Fn(lambda s: F.softmax(s.float(), dim=-1).type_as(s)), x, dtype=dtype) == {"softmax": 1}
    assert replaced(Fn(lambda s, m: F.softmax(s + m, dim=-1)), x, mask, dtype=dtype) == {"masked_softmax": 1}
    assert replaced(Fn(lambda s, m: (s + m).softmax(-1)), x, torch.randn(1, 4, 16, 16), dtype=dtype) == {
        "masked_softmax": 1}
    assert replaced(Scores(), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), mask, dtype=dtype) == {
        "scaled_masked_softmax": 1}


def test_t5_softmax_near_misses_take_the_plain_softmax():
    """Masks the masked kernel does not read (2-d, broadcast along the keys, or of another dtype than the
    scores: the add promotes) leave the add to PyTorch and the softmax to the plain op."""
    x = torch.randn(2, 4, 16, 16)
    for mask in (causal(1, 16)[0, 0], causal(2, 16)[..., :1]):
        assert replaced(Fn(lambda s, m: F.softmax(s + m, dim=-1)), x, mask) == {"softmax": 1}
        assert replaced(T5Scores(in_place=False), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), mask) == {
            "softmax": 1}
    module = T5Scores(in_place=False).to(torch.bfloat16)
    args = (torch.randn(2, 4, 16, 8, dtype=torch.bfloat16), torch.randn(2, 4, 16, 8, dtype=torch.bfloat16),
            torch.randn(1, 4, 16, 16))  # a float32 bias: the sum is float32
    assert _matched_rules(torch.export.export(module, args)) == ["t5_softmax"]


def test_transformers_5_t5_eager_attention_fuses_its_mask_add():
    """transformers 5.x writes T5's eager attention as ``matmul(q, k.T) * scaling`` (1.0), ``+
    position_bias``, ``+ attention_mask``, then a softmax of the scores' dtype. The last add and the
    softmax are the unscaled masked op; the scaling by 1.0 and the bias add stay with PyTorch (one
    kernel could take them only by reading two masks)."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                feed_forward_proj="gated-gelu", attn_implementation="eager")
    encoder = transformers.T5EncoderModel(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    pad = torch.ones(2, 16, dtype=torch.long)
    pad[1, 12:] = 0
    for kwargs in ({}, {"attention_mask": pad}):
        ep = torch.export.export(encoder, (ids,), kwargs=kwargs)
        new = fxkern.apply(ep, lib.rules(), verify=True)
        assert library_calls(new) == {"add_rms_norm": 4, "rms_norm": 1, "geglu_new": 2, "masked_softmax": 2}
        with torch.no_grad():
            torch.testing.assert_close(new.module()(ids, **kwargs).last_hidden_state,
                                       encoder(ids, **kwargs).last_hidden_state, rtol=0, atol=0)


def test_unscaled_masked_op_is_its_pattern_and_runs_the_scaled_kernels_at_a_scale_of_1():
    from fxkern.library import softmax as sm

    x, mask = torch.randn(2, 3, 8, 16), torch.randn(2, 1, 8, 16)
    op = lib.op("masked_softmax")
    torch.testing.assert_close(op(x, mask), F.softmax(x + mask, dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(op(x, mask), lib.op("scaled_masked_softmax")(x, mask, 1.0), rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::masked_softmax: .*must both be 4-d"):
        op(x, torch.zeros(8, 16))
    with pytest.raises(fxkern.KernelInputError, match="does not broadcast onto scores"):
        op(x, torch.zeros(2, 2, 8, 16))
    calls = []
    sm._unscaled_masked_on_cuda(lambda *a: calls.append(a))(x, mask)
    assert calls == [(x, mask, 1.0)]


# ---- the ops' own references ------------------------------------------------------------------------


def test_ops_on_cpu_are_their_patterns():
    torch.manual_seed(0)
    x, w, b, r = torch.randn(3, 64), torch.randn(64), torch.randn(64), torch.randn(3, 64)
    torch.testing.assert_close(lib.op("rms_norm")(x, w, 1e-6), lib.llama_rmsnorm(x, w, 1e-6))
    torch.testing.assert_close(lib.op("bias_gelu_tanh_residual")(x, b, r), F.gelu(x + b, approximate="tanh") + r)
    new_gelu = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    torch.testing.assert_close(lib.op("gelu_new")(x), new_gelu)
    torch.testing.assert_close(lib.op("softmax")(x), x.softmax(-1))
    with pytest.raises(fxkern.KernelInputError):
        lib.op("swiglu")(x, r.to(torch.float16))


# ---- rotary position embedding ----------------------------------------------------------------------


def rotate_half(x):
    """transformers' ``rotate_half``, line for line."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HFRope(nn.Module):
    """transformers' ``apply_rotary_pos_emb`` on queries and keys as attention projects them
    (``view(b, s, h, d).transpose(1, 2)``), cos and sin ``(b, s, d)`` unsqueezed over the heads."""

    def forward(self, q_proj, k_proj, cos, sin):
        b, s, _ = q_proj.shape
        q = q_proj.view(b, s, -1, 16).transpose(1, 2)
        k = k_proj.view(b, s, -1, 16).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed


def litgpt_apply_rope(x, cos, sin):
    """litgpt's ``apply_rope``: the same rotation written out, cast back to x's dtype at the end."""
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    if cos.dim() > 1:
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


def rope_tables(b, s, d, dtype=torch.float32):
    pos = torch.arange(s, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None]
    emb = torch.cat((pos, pos), dim=-1).expand(b, s, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rotary_embedding_forms(dtype):
    torch.manual_seed(0)
    cos, sin = rope_tables(2, 8, 16)
    q_proj, k_proj = torch.randn(2, 8, 64), torch.randn(2, 8, 32)  # 4 query heads of 16, 2 key heads
    assert replaced(HFRope(), q_proj, k_proj, cos, sin, dtype=dtype) == {"rotary_embedding": 2}
    assert replaced(Fn(litgpt_apply_rope), torch.randn(2, 4, 8, 16), cos, sin, dtype=dtype) == {"rotary_embedding": 1}
    one = Fn(lambda x, c, s: (x * c) + (rotate_half(x) * s))  # cos shared by the batch: (1, 1, s, d)
    assert replaced(one, torch.randn(2, 4, 8, 16), cos[:1, None], sin[:1, None], dtype=dtype) == {"rotary_embedding": 1}
    tables_first = Fn(lambda x, c, s: c * x + s * rotate_half(x))  # the tables written first in both products
    assert replaced(tables_first, torch.randn(2, 4, 8, 16), cos[:, None], sin[:, None], dtype=dtype) == {"rotary_embedding": 1}


def test_llama_queries_and_keys_are_rotated_by_one_kernel_each(rules):
    model = tiny_llama(torch.bfloat16)  # 4 query heads, 2 key/value heads
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 16)),), kwargs={"use_cache": False})
    report = fxkern.explain(ep, rules)
    for name in ("rotary_embedding", "rotary_embedding_repeat_kv", "repeat_kv"):
        matches = report[name].matches
        assert len(matches) == 1 and all(m.location for m in matches), name


class GQAttention(nn.Module):
    """transformers' grouped-query attention up to SDPA's inputs: queries and keys rotated, keys and values
    repeated for each query head of their group. ``cached`` also returns the rotated keys (what a KV
    cache stores), so the rotation's result is used twice."""

    def __init__(self, n_rep, cached=False):
        super().__init__()
        self.n_rep, self.cached = n_rep, cached

    def forward(self, q_proj, k_proj, v_proj, cos, sin):
        b, s, _ = q_proj.shape
        q, k, v = (t.view(b, s, -1, 16).transpose(1, 2) for t in (q_proj, k_proj, v_proj))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        out = (q, repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep))  # what SDPA takes
        return out + (k,) if self.cached else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_grouped_query_keys_are_rotated_and_repeated_in_one_kernel(dtype):
    torch.manual_seed(0)
    cos, sin = rope_tables(2, 8, 16)
    kv = torch.randn(2, 8, 32)  # 2 key/value heads of 16
    for n_rep in (2, 4):
        q = torch.randn(2, 8, 32 * n_rep)
        assert replaced(GQAttention(n_rep), q, kv, kv.flip(0), cos, sin, dtype=dtype) == {
            "rotary_embedding": 1, "rotary_embedding_repeat_kv": 1, "repeat_kv": 1}
    # the rotated keys also leave the graph (a cache): the rotation and the repeat stay two kernels
    q = torch.randn(2, 8, 64)
    assert replaced(GQAttention(2, cached=True), q, kv, kv.flip(0), cos, sin, dtype=dtype) == {
        "rotary_embedding": 2, "repeat_kv": 2}
    # one key/value head per query head: transformers repeats nothing, and there is nothing to replace
    assert replaced(GQAttention(1), torch.randn(2, 8, 32), kv, kv.flip(0), cos, sin, dtype=dtype) == {
        "rotary_embedding": 2}


def test_repeat_kv_near_misses_are_left_alone(rules):
    x = torch.randn(2, 2, 8, 16)
    # torchtune's form (a -1 in the expand, then flatten) and repeat_interleave leave other graphs
    torchtune = Fn(lambda k: k.unsqueeze(2).expand(2, 2, 3, -1, 16).flatten(1, 2))
    interleave = Fn(lambda k: k.repeat_interleave(3, dim=1))
    for module in (torchtune, interleave):
        assert "repeat_kv" not in replaced(module, x)


def test_repeat_kv_with_a_dynamic_sequence_length_is_left_to_pytorch(rules):
    """The expand's sizes are then symbols, not the literals the pattern captures; PyTorch keeps the copy."""
    x = torch.randn(2, 2, 8, 16)
    s = torch.export.Dim("s", min=2, max=64)
    try:
        ep = torch.export.export(Fn(lambda k: repeat_kv(k, 2)), (x,), dynamic_shapes=(({2: s},),))
    except torch._dynamo.exc.UserError as e:  # torch 2.11 cannot prove min(16*s, 32*s) == 16*s
        pytest.skip(f"torch {torch.__version__} does not export repeat_kv with a dynamic length: {str(e)[:120]}")
    assert not fxkern.explain(ep, rules)["repeat_kv"].matches
    other = torch.randn(2, 2, 13, 16)
    torch.testing.assert_close(fxkern.apply(ep, rules).module()(other), repeat_kv(other, 2), rtol=0, atol=0)


def test_repeat_ops_check_their_sizes():
    op, fused = lib.op("repeat_kv"), lib.op("rotary_embedding_repeat_kv")
    x, (cos, sin) = torch.randn(2, 8, 4, 16).transpose(1, 2), rope_tables(2, 8, 16)
    cos, sin = cos[:, None], sin[:, None]
    torch.testing.assert_close(op(x, 2, 4, 3, 8, 16, 12), repeat_kv(x, 3), rtol=0, atol=0)
    torch.testing.assert_close(fused(x, cos, sin, 8, 2, 4, 3, 8, 16, 12), repeat_kv(x * cos + rotate_half(x) * sin, 3),
                               rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"repeat_kv: heads = 10 must be kv_heads \* n_rep = 4 \* 3"):
        op(x, 2, 4, 3, 8, 16, 10)
    with pytest.raises(fxkern.KernelInputError, match=r"x \(2, 4, 8, 16\) is not \(batch, kv_heads, seq, head_dim\)"):
        op(x, 2, 4, 3, 9, 16, 12)
    with pytest.raises(fxkern.KernelInputError, match=r"x \(4, 8, 16\) must be 4-d"):
        op(x[0], 2, 4, 3, 8, 16, 12)
    with pytest.raises(fxkern.KernelInputError, match=r"rotary_embedding_repeat_kv: half = 4 rotates"):
        fused(x, cos, sin, 4, 2, 4, 3, 8, 16, 12)
    # repeated twice: 2**32 elements. The fake impl takes them, as eager does; the kernel's CUDA path refuses
    # them (SizeLimitError, on which the op runs its reference), the repeat checked, not just x
    big = torch.empty(8, 1024, 2048, 128, device="meta")
    assert op(big, 8, 1024, 2, 2048, 128, 2048).shape == (8, 2048, 2048, 128)
    tables = (torch.empty(1, 1, 2048, 128, device="meta"),) * 2
    for name, args in (("repeat_kv", ()), ("rotary_embedding_repeat_kv", (*tables, 64))):
        on_cuda = fxkern.kernel_op(f"fxkern_lib::{name}").eager_fn
        with pytest.raises(fxkern.SizeLimitError, match=r"the output \(8, 2048, 2048, 128\) has more than 2\*\*31 - 1"):
            on_cuda(big, *args, 8, 1024, 2, 2048, 128, 2048)


class NormedRotatedHeads(nn.Module):
    """Qwen3's and Gemma 3's attention up to SDPA's inputs: the queries and keys normalised per head
    (Qwen3 before the transpose, Gemma 3 after it), rotated, the keys and values repeated for each
    query head of their group. ``cached`` also returns the rotated keys (what a KV cache stores)."""

    def __init__(self, norm, heads_first, n_rep, cached=False, head_dim=16):
        super().__init__()
        self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)
        for w in (self.q_norm.weight, self.k_norm.weight):
            nn.init.normal_(w)
        self.heads_first, self.n_rep, self.cached, self.head_dim = heads_first, n_rep, cached, head_dim

    def forward(self, q_proj, k_proj, v_proj, cos, sin):
        b, s, _ = q_proj.shape
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q_proj, k_proj, v_proj))
        if self.heads_first:  # Gemma 3
            q, k = self.q_norm(q.transpose(1, 2)), self.k_norm(k.transpose(1, 2))
        else:  # Qwen3
            q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        out = (q, repeat_kv(k, self.n_rep), repeat_kv(v.transpose(1, 2), self.n_rep))
        return out + (k,) if self.cached else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_query_and_key_norms_are_one_kernel_with_their_rotation(family, dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    norm, heads_first = (Gemma3RMSNorm, True) if family == "gemma3" else (Qwen3RMSNorm, False)
    prefix = "gemma_" if family == "gemma3" else ""
    cos, sin = rope_tables(2, 8, 16)
    kv = torch.randn(2, 8, 32)  # 2 key/value heads of 16
    q = torch.randn(2, 8, 64)
    assert replaced(NormedRotatedHeads(norm, heads_first, 2), q, kv, kv.flip(0), cos, sin, dtype=dtype) == {
        f"{prefix}rms_norm_rotary_embedding": 1, f"{prefix}rms_norm_rotary_embedding_repeat_kv": 1, "repeat_kv": 1}
    # one key/value head per query head: nothing repeated, both rotations fused with their norms
    assert replaced(NormedRotatedHeads(norm, heads_first, 1), q[..., :32], kv, kv.flip(0), cos, sin, dtype=dtype) == {
        f"{prefix}rms_norm_rotary_embedding": 2}
    # the rotated keys also leave the graph (a cache): their norm and rotation stay one kernel, the
    # repeat another
    cached = NormedRotatedHeads(norm, heads_first, 2, cached=True)
    assert replaced(cached, q, kv, kv.flip(0), cos, sin, dtype=dtype) == {
        f"{prefix}rms_norm_rotary_embedding": 2, "repeat_kv": 2}


def test_query_and_key_norms_with_rotation_under_a_dynamic_sequence_length(rules):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    model = NormedRotatedHeads(Qwen3RMSNorm, False, 1).eval()
    cos, sin = rope_tables(2, 8, 16)
    args = (torch.randn(2, 8, 32), torch.randn(2, 8, 32), torch.randn(2, 8, 32), cos, sin)
    seq = torch.export.Dim("seq", min=2, max=4096)
    ep = torch.export.export(model, args, dynamic_shapes=tuple({1: seq} for _ in args))
    new = fxkern.apply(ep, rules, verify=True)
    assert len(fxkern.explain(ep, rules)["rms_norm_rotary_embedding"].matches) == 2
    cos, sin = rope_tables(2, 13, 16)
    other = (torch.randn(2, 13, 32), torch.randn(2, 13, 32), torch.randn(2, 13, 32), cos, sin)
    for got, want in zip(new.module()(*other), model(*other)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_norms_in_the_other_order_stay_two_kernels(rules):
    """Llama's norm after the transpose and Gemma's before it have no fused op: the norm and the
    rotation are each replaced alone."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    cos, sin = rope_tables(2, 8, 16)
    q = torch.randn(2, 8, 64)
    for norm, heads_first, name in ((LlamaRMSNorm, True, "rms_norm"), (GemmaRMSNorm, False, "gemma_rms_norm")):
        got = replaced(NormedRotatedHeads(norm, heads_first, 1), q[..., :32], q[..., 32:], q[..., :32], cos, sin)
        assert got == {name: 2, "rotary_embedding": 2}, got


def test_heads_the_fused_kernel_does_not_take_run_the_norm_and_rotation_apart(rules):
    """Heads of more than 256 columns (past what a warp holds) and a norm weight of another dtype than
    the heads' (the products then promote) are left to the norm and rotary rules."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    cos, sin = rope_tables(2, 4, 512)
    wide = NormedRotatedHeads(Qwen3RMSNorm, False, 1, head_dim=512)
    x = torch.randn(2, 4, 1024)
    assert replaced(wide, x, x.flip(0), x, cos, sin) == {"rms_norm": 2, "rotary_embedding": 2}
    # float32 norm weights on bfloat16 heads: the norm's output is float32, and so is its rotation,
    # which no library op computes; nothing is replaced
    cos, sin = rope_tables(2, 8, 16)
    mixed = NormedRotatedHeads(Qwen3RMSNorm, False, 1).to(torch.bfloat16)
    mixed.q_norm.float()
    q = torch.randn(2, 8, 32, dtype=torch.bfloat16)
    ep = torch.export.export(mixed.eval(), (q, q.flip(0), q, cos.bfloat16(), sin.bfloat16()))
    report = fxkern.explain(ep, rules)
    # the keys (a bfloat16 norm) are fused; the queries are not, and explain says why
    assert len(report["rms_norm_rotary_embedding"].matches) == 1 and report["rms_norm_rotary_embedding"].near_misses
    new = fxkern.apply(ep, rules, verify=True)
    for got, want in zip(new.module()(q, q.flip(0), q, cos.bfloat16(), sin.bfloat16()),
                         mixed(q, q.flip(0), q, cos.bfloat16(), sin.bfloat16())):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_norm_rotary_ops_on_cpu_are_their_patterns_and_check_their_inputs():
    from fxkern.library import norm_rotary

    torch.manual_seed(0)
    x, w = torch.randn(2, 8, 4, 16), torch.randn(16)  # (B, S, H, D) as Qwen3's norm reads it
    cos, sin = rope_tables(2, 8, 16)
    cos, sin = cos[:, None], sin[:, None]
    sizes = (2, 4, 3, 8, 16, 12)
    for name, xs in (("rms_norm_rotary_embedding", x), ("gemma_rms_norm_rotary_embedding", x.transpose(1, 2))):
        op, pattern = lib.op(name), getattr(norm_rotary, name)
        got, want = op(xs, w, cos, sin, 1e-6, 8), pattern(xs, w, cos, sin, 1e-6, 8)
        # laid out as eager lays it out: the (B, H, S, D) view of (B, S, H, D) memory, the projection's
        assert got.shape == (2, 4, 8, 16) and got.stride() == want.stride() == (512, 16, 64, 1)
        assert op(xs.contiguous(), w, cos, sin, 1e-6, 8).stride() == pattern(xs.contiguous(), w, cos, sin, 1e-6,
                                                                              8).stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.library.opcheck(op, (xs, w, cos, sin, 1e-6, 8))
        repeat = lib.op(f"{name}_repeat_kv")
        torch.testing.assert_close(repeat(xs, w, cos, sin, 1e-6, 8, *sizes),
                                   repeat_kv(pattern(xs, w, cos, sin, 1e-6, 8), 3), rtol=0, atol=0)
        torch.library.opcheck(repeat, (xs, w, cos, sin, 1e-6, 8, *sizes))
    op = lib.op("rms_norm_rotary_embedding")
    with pytest.raises(fxkern.KernelInputError, match=r"x \(8, 4, 16\) must be 4-d \(batch, positions, heads"):
        op(x[0], w, cos, sin, 1e-6, 8)
    with pytest.raises(fxkern.KernelInputError, match=r"weight torch.float16 \(16,\) must be x's dtype"):
        op(x, w.half(), cos, sin, 1e-6, 8)
    wrong_axes = r"cos \(and sin\) \(2, 1, 8, 16\) does not broadcast onto x.transpose\(1, 2\) \(2, 8, 4, 16\)"
    with pytest.raises(fxkern.KernelInputError, match=wrong_axes):
        op(x.transpose(1, 2).contiguous(), w, cos, sin, 1e-6, 8)  # (B, H, S, D) where (B, S, H, D) belongs
    with pytest.raises(fxkern.KernelInputError, match=r"head_dim 512 is more than 256.*and rotary_embedding apart"):
        op(torch.randn(1, 2, 2, 512), torch.randn(512), *[t.expand(1, 1, 2, 512) for t in (cos[:1, :, :2, :1],) * 2],
           1e-6, 256)
    with pytest.raises(fxkern.KernelInputError, match=r"heads = 10 must be kv_heads \* n_rep = 4 \* 3"):
        lib.op("rms_norm_rotary_embedding_repeat_kv")(x, w, cos, sin, 1e-6, 8, 2, 4, 3, 8, 16, 10)


def test_rotary_op_keeps_eagers_layout_under_dynamic_shapes():
    """Exported with a dynamic batch and sequence, the replaced node's fake value has the strides of the
    pattern's output (the projection's (B, S, H, D) memory, in symbols), and the program runs other sizes."""

    def rope(h, cos, sin):
        b, s, _ = h.shape
        q = h.view(b, s, 4, 16).transpose(1, 2)
        return q * cos + rotate_half(q) * sin

    (cos, sin), h = rope_tables(2, 8, 16), torch.randn(2, 8, 64)
    cos, sin = cos[:, None], sin[:, None]
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=4096)
    ep = torch.export.export(Fn(rope), (h, cos, sin),
                             dynamic_shapes={"args": ({0: batch, 1: seq}, {0: batch, 2: seq}, {0: batch, 2: seq})})
    new = fxkern.apply(ep, lib.rules(), verify=True)
    (node,) = [n for n in new.graph.nodes if n.target is lib.op("rotary_embedding").default]
    want = ep.graph.output_node().args[0][0].meta["val"]
    assert node.meta["val"].stride() == want.stride()  # (64 * seq, 16, 64, 1)
    (cos, sin), h = rope_tables(3, 5, 16), torch.randn(3, 5, 64)
    got, want = new.module()(h, cos[:, None], sin[:, None]), rope(h, cos[:, None], sin[:, None])
    assert got.stride() == want.stride() == (320, 16, 64, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rotary_near_misses_are_left_alone():
    x, (cos, sin) = torch.randn(2, 4, 8, 16), rope_tables(1, 8, 16)
    cos, sin = cos[:, None], sin[:, None]

    def interleaved(x, c, s):  # GPT-J's rotate_every_two: another computation, the interleaved op's
        x1, x2 = x[..., ::2], x[..., 1::2]
        return x * c + torch.stack((-x2, x1), dim=-1).flatten(-2) * s

    def quarter(x, c, s):  # halves that are not halves: the kernel would rotate other columns
        return x * c + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * s

    assert replaced(Fn(interleaved), x, cos, sin) == {"interleaved_rotary_embedding": 1}
    assert replaced(Fn(quarter), x, cos, sin) == {}
    three_d = Fn(lambda x, c, s: x * c + rotate_half(x) * s)
    assert replaced(three_d, x[0], cos[0], sin[0]) == {}
    # float32 tables with bfloat16 queries: the products promote to float32, which the kernel does not compute
    module = Fn(lambda x, c, s: x * c + rotate_half(x) * s)
    ep = torch.export.export(module, (x.to(torch.bfloat16), cos, sin))
    assert not fxkern.explain(ep, lib.rules())["rotary_embedding"].matches


def test_rotary_op_checks_its_inputs_and_lays_out_its_result_as_eager_does():
    from fxkern.library import rotary

    op = lib.op("rotary_embedding")
    x, (cos, sin) = torch.randn(2, 8, 4, 16).transpose(1, 2), rope_tables(2, 8, 16)
    cos, sin = cos[:, None], sin[:, None]
    y, want = op(x, cos, sin, 8), x * cos + rotate_half(x) * sin
    # the projection's view keeps its (B, S, H, D) memory, a contiguous x a contiguous result; the
    # fake impl (export's) says the same
    assert y.shape == x.shape and y.stride() == want.stride() == (512, 16, 64, 1)
    assert op(x.contiguous(), cos, sin, 8).is_contiguous()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert op(mode.from_tensor(x), mode.from_tensor(cos), mode.from_tensor(sin), 8).stride() == want.stride()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.library.opcheck(op, (x, cos, sin, 8))
    # the partial forms end in a cat, contiguous in eager, and so here
    partial = lib.op("partial_rotary_embedding")
    assert partial(x, cos[..., :8], sin[..., :8], 4, 8).stride() == rotary.partial_rotary_embedding(
        x, cos[..., :8], sin[..., :8], 4, 8).stride() == (512, 128, 16, 1)
    with pytest.raises(fxkern.KernelInputError, match=r"x \(4, 8, 16\) must be 4-d"):
        op(x[0], cos[0], sin[0], 8)
    with pytest.raises(fxkern.KernelInputError, match=r"must be 4-d like x.*cos.unsqueeze\(1\)"):
        op(x, cos[:, 0], sin[:, 0], 8)
    with pytest.raises(fxkern.KernelInputError, match="give cos and sin x's dtype"):
        op(x, cos.double(), sin.double(), 8)
    with pytest.raises(fxkern.KernelInputError, match=r"half = 4 rotates a last axis of 8"):
        op(x, cos, sin, 4)
    with pytest.raises(fxkern.KernelInputError, match=r"cos \(and sin\) .* does not broadcast onto x"):
        op(x, cos[:, :, :3], sin[:, :, :3], 8)
    with pytest.raises(fxkern.KernelInputError, match="must have one shape"):
        op(x, cos, sin[:1], 8)
    wide = cos[:1].expand(2, 4, 8, 16)  # expanded over batch and heads: read at its own size
    c, s = rotary._compact(wide, sin[:1].expand(2, 4, 8, 16))
    assert c.shape == s.shape == (1, 1, 8, 16) and c.is_contiguous() and s.is_contiguous()
    # cos expanded over the batch, sin not: the kernel reads both with cos's sizes, so only the axis
    # both broadcast (the heads) is narrowed
    c, s = rotary._compact(wide, sin.expand(2, 4, 8, 16))
    assert c.shape == s.shape == (2, 1, 8, 16)
    torch.testing.assert_close(op(x, wide, sin.expand(2, 4, 8, 16), 8), x * wide + rotate_half(x) * sin, rtol=0, atol=0)


def test_gpt_neox_partial_rotary_is_one_kernel_with_its_concatenation(rules):
    """GPT-NeoX rotates only the first quarter of each head (``q[..., :rotary_ndims]``) and concatenates
    the rest back: one op for the slices, the rotation and the ``cat``."""
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                                     attn_implementation="eager")
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    ep = torch.export.export(model, (torch.randint(0, 128, (2, 16)),), kwargs={"use_cache": False})
    new = fxkern.apply(ep, rules, verify=True)
    calls = [n for n in new.graph.nodes if n.target == lib.op("partial_rotary_embedding").default]
    assert len(calls) == 2 and {n.args[3:] for n in calls} == {(2, 4)}  # head size 16, a quarter rotated
    assert not [n for n in new.graph.nodes if n.target == lib.op("rotary_embedding").default]
    # no (b, h, s, d) cat of queries or keys is left (transformers 5.24 also leaves the cos/sin table's
    # 3-d cat(freqs, freqs) in the graph)
    assert not [n for n in new.graph.nodes if n.target == torch.ops.aten.cat.default and n.meta["val"].dim() == 4]


def partial_rope(x, cos, sin):
    """transformers' partial-rotary ``apply_rotary_pos_emb`` (GPT-NeoX, Phi-3) for one of q, k."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_partial_rotary_forms(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 16)
    for rot in (4, 8, 12):  # a quarter, a half, three quarters (Phi-4's) of the head
        cos, sin = rope_tables(2, 8, rot)
        assert replaced(Fn(partial_rope), x, cos[:, None], sin[:, None], dtype=dtype) == {"partial_rotary_embedding": 1}
    # the whole head: export drops the slice x[..., :16] and keeps the empty x[..., 16:] and the cat
    cos, sin = rope_tables(2, 8, 16)
    assert replaced(Fn(partial_rope), x, cos[:, None], sin[:, None], dtype=dtype) == {"partial_rotary_embedding": 1}
    # Phi-3's grouped-query keys, partly rotated and repeated: one kernel
    cos, sin = rope_tables(2, 8, 8)
    keys = Fn(lambda k, c, s: repeat_kv(partial_rope(k, c, s), 2))
    assert replaced(keys, x, cos[:, None], sin[:, None], dtype=dtype) == {"partial_rotary_embedding_repeat_kv": 1}
    cos, sin = rope_tables(2, 8, 16)
    assert replaced(keys, x, cos[:, None], sin[:, None], dtype=dtype) == {"rotary_embedding_repeat_kv": 1}


def test_rotary_eager_path_refuses_more_than_int32_elements():
    """The CUDA path (run here on meta tensors: it raises before any launch) names the limit, even
    for a contiguous x, which it would otherwise hand to a kernel that indexes in 32 bits."""
    x = torch.empty(1, 32, 2**19 + 1, 128, device="meta")  # 2**31 + 4096 elements
    cos = torch.empty(1, 1, 2**19 + 1, 128, device="meta")
    on_cuda = fxkern.kernel_op("fxkern_lib::rotary_embedding").eager_fn
    with pytest.raises(fxkern.KernelInputError, match=r"more than 2\*\*31 - 1 elements.*split the batch"):
        on_cuda(x, cos, cos.clone(), 64)


def test_rows_written_more_than_once_run_their_own_kernel():
    """The eager path launches the repeating kernel for n_rep > 1 only: rows written once keep the
    kernel measured without the evict-first hint (docs/library.md)."""
    from fxkern.library import rotary

    launched = []
    launchers = (lambda *a: launched.append("plain"), lambda *a: launched.append("repeat"))
    x, (cos, sin) = torch.randn(2, 4, 8, 16), rope_tables(2, 8, 16)
    rope = rotary._eager("fxkern_lib::rotary_embedding_repeat_kv", launchers, rotary._rotary_repeat_output, True)
    rope(x, cos[:, None], sin[:, None], 8, 2, 4, 2, 8, 16, 8)
    rope(x, cos[:, None], sin[:, None], 8, 2, 4, 1, 8, 16, 4)  # n_rep 1: rows written once
    copy = rotary._eager("fxkern_lib::repeat_kv", launchers, rotary._repeat_output, False)
    copy(x, 2, 4, 3, 8, 16, 12)
    assert launched == ["repeat", "plain", "repeat"]


def test_norm_rotary_runs_its_16_byte_kernel_where_packs_fit():
    """The eager path launches norm_rotary_packs (or its repeating twin, for n_rep > 1) where half, the
    walk's strides and every pointer allow 16-byte packs, and the kernel for any alignment elsewhere:
    the packs kernel writes nothing where they do not fit."""
    from fxkern.library import norm_rotary

    launched = []

    def launcher(kind):
        return lambda *a: launched.append(kind)

    launchers = (launcher("any"), {4: launcher("packs 32-bit"), 2: launcher("packs")},
                 {4: launcher("packs_repeat 32-bit"), 2: launcher("packs_repeat")})
    qwen = norm_rotary._eager(norm_rotary._Form("rms_norm_rotary_embedding", False, False), launchers)
    keys = norm_rotary._eager(norm_rotary._Form("rms_norm_rotary_embedding_repeat_kv", False, True), launchers)
    b, s, h, d = 2, 8, 4, 16
    x, w, (cos, sin) = torch.randn(b, s, h, d), torch.randn(d), rope_tables(b, s, d)
    cos, sin = cos[:, None], sin[:, None]
    qwen(x, w, cos, sin, 1e-6, d // 2)
    keys(x, w, cos, sin, 1e-6, d // 2, b, h, 2, s, d, 2 * h)
    keys(x, w, cos, sin, 1e-6, d // 2, b, h, 1, s, d, h)  # n_rep 1: rows written once
    past = torch.randn(b * s * h * d + 1)[1:].view(b, s, h, d)  # one element past 16-byte alignment
    qwen(past, w, cos, sin, 1e-6, d // 2)
    qwen(x, torch.randn(d + 1)[1:], cos, sin, 1e-6, d // 2)  # the weight past alignment
    wide = torch.randn(b, s, h, d + 2)[..., :d]  # rows d + 2 apart: strides not whole packs
    qwen(wide, w, cos, sin, 1e-6, d // 2)
    assert launched == ["packs 32-bit", "packs_repeat 32-bit", "packs 32-bit", "any", "any", "any"]
    # 16-bit types take the packs kernels' own grid, float32 their twins' (4096 elements a block)
    launched.clear()
    half, bf = (x.to(torch.bfloat16), w.to(torch.bfloat16)), (cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    qwen(*half, *bf, 1e-6, d // 2)
    keys(*half, *bf, 1e-6, d // 2, b, h, 2, s, d, 2 * h)
    assert launched == ["packs", "packs_repeat"]
    # a dtype the kernels do not take is refused by name before a launcher is picked (a review found a
    # KeyError from the launchers' table for float64)
    launched.clear()
    f64 = [t.double() for t in (x, w, cos, sin)]
    with pytest.raises(fxkern.KernelInputError, match="x is torch.float64; the kernels take torch.float32"):
        qwen(*f64, 1e-6, d // 2)
    assert launched == []


def test_only_the_repeating_kernels_store_evict_first():
    """st.global.cs in the PTX of the eager path's repeating kernels (rotary's and norm+rotary's), in
    none of the kernels for rows written once."""
    from fxkern.library import norm_rotary, rotary

    lib.rules()
    assert "st.global.cs" not in fxkern.kernel_op(norm_rotary.STRIDED).compiled.ptx
    for plain, repeat in ((rotary.STRIDED, rotary.STRIDED_REPEAT), (norm_rotary.PACKS, norm_rotary.PACKS_REPEAT),
                          (norm_rotary.PACKS + "_32bit", norm_rotary.PACKS_REPEAT + "_32bit")):
        assert "st.global.cs" not in fxkern.kernel_op(plain).compiled.ptx, plain
        ptx = fxkern.kernel_op(repeat).compiled.ptx
        entries = ptx.split(".entry ")[1:]
        assert len(entries) == 3, repeat  # float32, float16, bfloat16
        assert all("st.global.cs.v4" in e for e in entries), repeat


def test_partial_rotary_op_checks_its_inputs():
    op = lib.op("partial_rotary_embedding")
    x, (cos, sin) = torch.randn(2, 4, 8, 16), rope_tables(2, 8, 4)
    cos, sin = cos[:, None], sin[:, None]
    torch.testing.assert_close(op(x, cos, sin, 2, 4), partial_rope(x, cos, sin), rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"half = 3 rotates 6 columns, but rotary_dim is 4"):
        op(x, cos, sin, 3, 4)
    wide = rope_tables(2, 8, 20)
    with pytest.raises(fxkern.KernelInputError, match=r"rotary_dim = 20 is more than x's last axis, 16"):
        op(x, wide[0][:, None], wide[1][:, None], 10, 20)
    with pytest.raises(fxkern.KernelInputError, match=r"cos \(and sin\) .* does not broadcast onto x\[..., :rotary_dim\]"):
        op(x, cos, sin, 4, 8)


def test_rotary_rule_with_a_dynamic_sequence_length(rules):
    cos, sin = rope_tables(2, 8, 16)
    args = (torch.randn(2, 8, 64), torch.randn(2, 8, 32), cos, sin)
    s = torch.export.Dim("s", min=2, max=64)
    ep = torch.export.export(HFRope(), args, dynamic_shapes=({1: s}, {1: s}, {1: s}, {1: s}))
    new = fxkern.apply(ep, rules)
    assert sum(n.target == lib.op("rotary_embedding").default for n in new.graph.nodes) == 2
    cos, sin = rope_tables(2, 13, 16)
    other = (torch.randn(2, 13, 64), torch.randn(2, 13, 32), cos, sin)
    for got, want in zip(new.module()(*other), HFRope()(*other)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- residual add + LayerNorm -----------------------------------------------------------------------


class PostNorm(nn.Module):
    """BERT's ``BertSelfOutput``: ``self.LayerNorm(hidden_states + input_tensor)``, the sum used once."""

    def __init__(self, d=32, bias=True):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(d, eps=1e-12, bias=bias)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(hidden_states + input_tensor)


class PreNormBlock(nn.Module):
    """GPT-2's block tail: the residual add, then ``ln_2``, the sum kept as the next residual."""

    def __init__(self, d=32, bias=True):
        super().__init__()
        self.ln_2 = nn.LayerNorm(d, bias=bias)
        self.mlp = nn.Linear(d, d)

    def forward(self, attn_output, residual):
        hidden_states = attn_output + residual
        residual = hidden_states
        return residual + self.mlp(self.ln_2(hidden_states))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_add_layer_norm_forms(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    assert replaced(PostNorm(), x, r, dtype=dtype) == {"add_layer_norm": 1}
    assert replaced(PreNormBlock(), x, r, dtype=dtype) == {"add_layer_norm": 1}
    # nn.LayerNorm(d, bias=False) exports with None for the bias: the bias-free op
    assert replaced(PostNorm(bias=False), x, r, dtype=dtype) == {"add_layer_norm_no_bias": 1}
    assert replaced(PreNormBlock(bias=False), x, r, dtype=dtype) == {"add_layer_norm_no_bias": 1}


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_transformers_encoders_and_gpt2_fuse_each_residual_add_into_its_layer_norm(rules, family):
    torch.manual_seed(0)
    if family == "bert":  # two per layer (attention and FFN outputs); the embeddings' norm adds a broadcast
        model = transformers.BertModel(transformers.BertConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            attn_implementation="eager"))
    else:  # ln_2 of each block, ln_1 of the second, ln_f; the first ln_1 reads the embeddings
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, attn_implementation="eager"))
    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(model.eval(), (ids,), kwargs={"use_cache": False})
    new = fxkern.apply(ep, rules, verify=True)
    assert sum(n.target == lib.op("add_layer_norm").default for n in new.graph.nodes) == 4


def tiny_modernbert(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        cls_token_id=1, sep_token_id=2, **overrides)
    return transformers.ModernBertModel(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_modernbert_bias_free_add_layer_norms_and_first_half_geglu(dtype):
    """transformers' ModernBERT: its LayerNorms have no bias (``norm_bias=False``), each after a residual
    add (every layer's ``mlp_norm``, the second layer's ``attn_norm``, the ``final_norm``; the first
    layer's ``attn_norm`` is an Identity and the embeddings' norm follows no add), and its MLP takes the
    erf GELU of the first half of ``Wi``'s output times the second (``ModernBertMLP``). add_layer_norm's
    pattern has a bias and geglu_chunked the GELU on the second half: both missed it. The dropout
    (p=0) after the product stays in the export IR as ``aten.dropout(x, 0.0, False)``, outside the match."""
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    model = tiny_modernbert(dtype)
    assert not model.config.norm_bias and model.config.hidden_activation == "gelu"
    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(model, (ids,))
    new = fxkern.apply(ep, lib.rules(), verify=True)
    assert library_calls(new) == {"add_layer_norm_no_bias": 4, "geglu_chunked_gate_first": 2}
    other = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(new.module()(other).last_hidden_state, model(other).last_hidden_state, rtol=0, atol=0)
    assert replaced(ModernBertMLP(model.config), torch.randn(2, 8, 64), dtype=dtype) == {"geglu_chunked_gate_first": 1}


def test_modernbert_near_variants():
    """With ``norm_bias=True`` its norms take the op with a bias; with the tanh GELU its MLP is not
    GEGLU's erf kernel (left alone, as diffusers' tanh GEGLU is); the GELU on the second half is
    diffusers' form (``geglu_chunked``), not ModernBERT's."""
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    ids = torch.randint(0, 128, (2, 16))
    ep = torch.export.export(tiny_modernbert(norm_bias=True), (ids,))
    assert sorted({m.rule for m in fxkern.explain(ep, lib.rules()).matches}) == ["add_layer_norm", "geglu_chunked_gate_first"]
    tanh = tiny_modernbert(hidden_activation="gelu_pytorch_tanh")
    assert replaced(ModernBertMLP(tanh.config), torch.randn(2, 8, 64)) == {}

    def second_half(x):
        a, b = x.chunk(2, -1)
        return a * F.gelu(b)

    def other_axis(x):
        a, b = x.chunk(2, 1)
        return F.gelu(a) * b

    assert replaced(Fn(second_half), torch.randn(4, 32)) == {"geglu_chunked": 1}
    assert replaced(Fn(other_axis), torch.randn(4, 6, 32)) == {}
    x = torch.randn(3, 8)
    torch.testing.assert_close(lib.op("geglu_chunked_gate_first")(x), F.gelu(x[:, :4]) * x[:, 4:], rtol=0, atol=0)


def test_add_layer_norm_near_misses_and_checks():
    x, r = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    assert replaced(Fn(lambda a, b: F.layer_norm(a + b, (32,))), x, r) == {}  # no weight or bias
    two_axes = nn.LayerNorm((8, 32))
    assert replaced(Fn(lambda a, b: two_axes(a + b)), x, r) == {}
    ln = nn.LayerNorm(32)
    assert replaced(Fn(lambda a, b: ln(a + b)), x, r[:1, :1]) == {}  # a broadcast residual
    op = lib.op("add_layer_norm")
    w, b = torch.randn(32), torch.randn(32)
    y, h = op(x, r, w, b, 32, 1e-5)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (32,), w, b, 1e-5))
    with pytest.raises(fxkern.KernelInputError, match="normalized_size=16 must be the last axis"):
        op(x, r, w, b, 16, 1e-5)
    with pytest.raises(fxkern.KernelInputError, match="residual .* must have x's shape"):
        op(x, r[:1], w, b, 32, 1e-5)
    with pytest.raises(fxkern.KernelInputError, match=r"bias \(1, 32\) must be \(32,\)"):
        op(x, r, w, b[None], 32, 1e-5)
    # the bias-free op: its pattern on the CPU, the same checks, naming itself
    no_bias = nn.LayerNorm(32, bias=False)
    assert replaced(Fn(lambda a, c: no_bias(a + c)), x, r[:1, :1]) == {}  # a broadcast residual
    assert replaced(Fn(lambda a, c: F.layer_norm(a + c, (32,), w)), x, r) == {"add_layer_norm_no_bias": 1}
    op = lib.op("add_layer_norm_no_bias")
    y, h = op(x, r, w, 32, 1e-5)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (32,), w, None, 1e-5), rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match="add_layer_norm_no_bias: normalized_size=16 must be the last axis"):
        op(x, r, w, 16, 1e-5)
    with pytest.raises(fxkern.KernelInputError, match=r"add_layer_norm_no_bias: weight \(1, 32\) must be \(32,\)"):
        op(x, r, w[None], 32, 1e-5)


def test_an_unknown_library_op_lists_the_ops():
    with pytest.raises(KeyError, match=r"fxkern.library has no op 'nope'; its ops: .*rms_norm"):
        lib.op("nope")


class _MaskedScores(nn.Module):
    def forward(self, s, m):
        return F.softmax(s * 0.125 + m, dim=-1)


class _AddNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)

    def forward(self, x, r):
        return self.ln(x + r)


class _ChunkedSwiGLU(nn.Module):
    def forward(self, x):
        g, u = x.chunk(2, dim=-1)
        return u * F.silu(g)


@pytest.mark.parametrize("model, args", [
    (_MaskedScores(), (torch.randn(2, 4, 5, 6, dtype=torch.float64), torch.randn(2, 1, 5, 6, dtype=torch.float64))),
    (_AddNorm().double(), (torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64))),
    (_AddNorm(), (torch.randn(2, 3, 16, dtype=torch.bfloat16), torch.randn(2, 3, 16, dtype=torch.bfloat16))),
    (_ChunkedSwiGLU(), (torch.randn(3, 16, dtype=torch.float64),)),
], ids=["float64 scores", "float64 add + LayerNorm", "float32 LayerNorm of bfloat16", "float64 chunked SwiGLU"])
def test_ops_with_a_meta_fn_refuse_the_dtypes_their_kernels_refuse(rules, model, args):
    """Their meta_fns checked shapes only: these matches were replaced, and the CUDA launch then
    refused the dtypes at run time (found by a probe). Now they are near-misses, left as they are."""
    ep = torch.export.export(model, args)
    assert fxkern.apply(ep, rules) is ep
    assert any("refuses these inputs" in m.reason and "dtype" in m.reason for m in fxkern.explain(ep, rules).near_misses)


class _Float32Attention(nn.Module):
    def forward(self, s, m):  # transformers' eager attention
        return F.softmax(s * 0.125 + m, dim=-1, dtype=torch.float32).to(s.dtype)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_float32_softmax_matches_in_core_aten_on_any_device(rules, dtype, device):
    """In core ATen the float32 trace ends in _softmax (its casts are no-ops there), so a 16-bit model
    asked for float32 only and got the plain softmax; and the 16-bit trace's upcast held the example's
    device=cpu, which a graph on another device (meta stands in for cuda) never has (found by a probe)."""
    s, m = torch.randn(2, 4, 5, 6, dtype=dtype, device=device), torch.randn(2, 1, 5, 6, dtype=dtype, device=device)
    ep = torch.export.export(_Float32Attention(), (s, m)).run_decompositions()
    report = fxkern.explain(ep, rules)
    assert [m.rule for m in report.matches] == ["scaled_masked_softmax_float32"], str(report)
    if device == "cpu":
        new = fxkern.apply(ep, rules, verify=True)
        torch.testing.assert_close(new.module()(s, m), _Float32Attention()(s, m), rtol=0, atol=0)


class _MetaRMSNorm(nn.Module):
    """Meta's reference Llama RMSNorm, as gpt-fast and torchtune copy it."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class _MetaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = _MetaRMSNorm(64), _MetaRMSNorm(64)

    def forward(self, x, r):
        h = x + r
        return self.ffn_norm(h) + h, self.attention_norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_meta_reference_llama_rmsnorm_is_found_with_and_without_its_residual_add(dtype):
    """torch.export keeps Meta's float() and type_as(x), so Llama's pattern missed the norm of the
    reference Llama, gpt-fast and torchtune in every dtype (found by a probe)."""
    x, r = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    assert replaced(_MetaBlock(), x, r, dtype=dtype) == {"add_rms_norm": 1, "rms_norm": 1}


def _tiny_decoder(config_cls: str, model_cls: str, dtype, **config):
    """A transformers decoder of two small layers with random weights, in ``dtype``."""
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**config)
    return getattr(transformers, model_cls)(cfg).to(dtype).eval()


def _rewritten_logits_equal(model, ids):
    """Export with no cache, apply the library (verify=True), check the logits to the bit; the calls."""
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
    new = fxkern.apply(ep, lib.rules(), verify=True)
    other = torch.randint(0, 128, ids.shape)
    with torch.no_grad():
        torch.testing.assert_close(new.module()(other, use_cache=False).logits, model(other, use_cache=False).logits,
                                   rtol=0, atol=0)
    return library_calls(new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_olmo2_and_gpt_oss_norms_take_the_litgpt_ops(dtype):
    """OLMo 2's and GPT-OSS's RMSNorm ends ``(self.weight * hidden_states).to(input_dtype)``: the 16-bit
    weight times the float32 row, rounded once (litgpt's numbers). In float32 it is Llama's form, which
    its rules find first; in bfloat16 Llama's rules found none of them."""
    llama_like = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 16))
    olmo2 = _tiny_decoder("Olmo2Config", "Olmo2ForCausalLM", dtype, pad_token_id=1, eos_token_id=0, **llama_like)
    calls = _rewritten_logits_equal(olmo2, ids)
    # each layer norms its q and k projections and its two sublayers' outputs (before the residual adds),
    # and the final norm follows the last add
    want = {"litgpt_rms_norm": 8, "add_litgpt_rms_norm": 1} if dtype == torch.bfloat16 else {"rms_norm": 8,
                                                                                            "add_rms_norm": 1}
    assert {k: v for k, v in calls.items() if "norm" in k} == want
    gpt_oss = _tiny_decoder("GptOssConfig", "GptOssForCausalLM", dtype, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=8, **llama_like)
    assert gpt_oss.config._attn_implementation == "eager"  # GPT-OSS takes no SDPA (its sinks)
    calls = _rewritten_logits_equal(gpt_oss, ids)
    want = {"litgpt_rms_norm": 1, "add_litgpt_rms_norm": 4} if dtype == torch.bfloat16 else {"rms_norm": 1,
                                                                                            "add_rms_norm": 4}
    assert {k: v for k, v in calls.items() if "norm" in k} == want
    assert calls["sink_masked_softmax"] == 2  # each layer's attention, sliding-window and full
    assert calls["chunked_rotary_embedding"] == 4  # each layer's queries and keys
    assert calls["clamped_swiglu"] == 2 and "quick_gelu" not in calls  # each layer's experts' gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_bloom_float32_masked_softmax_is_the_unscaled_masked_op(dtype):
    """Bloom adds the causal mask to its ALiBi scores and takes ``F.softmax(..., dtype=torch.float32)``
    cast back: the unscaled masked op (one float32 softmax, one rounding)."""
    bloom = _tiny_decoder("BloomConfig", "BloomForCausalLM", dtype, vocab_size=128, hidden_size=64, n_layer=2, n_head=4)
    assert bloom.config._attn_implementation == "eager"
    calls = _rewritten_logits_equal(bloom, torch.randint(0, 128, (2, 16)))
    assert calls.get("masked_softmax") == 2 and "softmax" not in calls
    assert calls.get("megatron_gelu") == 2  # bloom_gelu_forward, its bias inside dense_h_to_4h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("generation", ["Cohere", "Cohere2"])
def test_cohere_layer_norm_with_and_without_its_residual_add(generation, dtype):
    """Cohere writes its LayerNorm out in float32 (``CohereLayerNorm``: no bias, centred variance, the
    weight multiplied in float32) and norms each layer's input once: the embeddings' norm is the plain
    op, every later one (and the final norm) the residual form, which takes the last of the layer's two
    adds (``residual + attention + mlp``)."""
    extra = {"sliding_window": 8} if generation == "Cohere2" else {}
    model = _tiny_decoder(f"{generation}Config", f"{generation}ForCausalLM", dtype, vocab_size=128, hidden_size=64,
                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    calls = _rewritten_logits_equal(model, torch.randint(0, 128, (2, 16)))
    assert {k: v for k, v in calls.items() if "norm" in k} == {"cohere_layer_norm": 1, "add_cohere_layer_norm": 2}


def test_cohere_layer_norm_ops_check_their_operands():
    x, r, w = torch.randn(3, 40), torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(lib.op("cohere_layer_norm")(x, w, 1e-5), lib.cohere_layer_norm(x, w, 1e-5), rtol=0, atol=0)
    y, h = lib.op("add_cohere_layer_norm")(x, r, w, 1e-5)
    torch.testing.assert_close(h, x + r, rtol=0, atol=0)
    # the kernel's arithmetic is F.layer_norm's without a bias, in float32
    torch.testing.assert_close(y, F.layer_norm(x + r, (40,), w, None, 1e-5))
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::cohere_layer_norm: weight \(4, 10\) must be \(40,\)"):
        lib.op("cohere_layer_norm")(x, w.view(4, 10), 1e-5)
    with pytest.raises(fxkern.KernelInputError, match=r"fxkern_lib::add_cohere_layer_norm: residual \(3, 1\)"):
        lib.op("add_cohere_layer_norm")(x, r[:, :1], w, 1e-5)


# ---- the interleaved rotary embedding: GPT-J, CodeGen, GLM, GLM-4, Cohere -------------------------------


def interleaved_tables(b, s, d, dtype=torch.float32):
    """(b, s, d) cos and sin whose columns come in equal pairs, as transformers' Cohere builds them."""
    pos = torch.arange(s, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None]
    emb = pos.repeat_interleave(2, dim=-1).expand(b, s, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _decoder_config(**extra):
    return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["gptj", "codegen", "glm", "glm4", "cohere", "cohere2"])
def test_interleaved_rotary_in_transformers_models(family, dtype):
    """Each family's queries and keys (two layers: four rotations) take one op each, and the logits stay
    equal to the bit: GPT-J and CodeGen rotate the first rotary_dim columns of their (B, S, H, D) heads,
    GLM and GLM-4 half of each head (partial_rotary_factor 0.5), Cohere the whole head, in float32 for
    16-bit models (``q.float()``: the float32 op)."""
    ids = torch.randint(0, 128, (2, 16))
    if family in ("gptj", "codegen"):
        name = {"gptj": "GPTJ", "codegen": "CodeGen"}[family]
        model = _tiny_decoder(f"{name}Config", f"{name}ForCausalLM", dtype, vocab_size=128, n_positions=64, n_embd=64,
                              n_layer=2, n_head=4, rotary_dim=8, n_inner=96, bos_token_id=0, eos_token_id=0)
        want = "partial_interleaved_rotary_embedding"
    elif family in ("glm", "glm4"):
        name = {"glm": "Glm", "glm4": "Glm4"}[family]
        model = _tiny_decoder(f"{name}Config", f"{name}ForCausalLM", dtype, head_dim=16, pad_token_id=0,
                              **_decoder_config())
        want = "partial_interleaved_rotary_embedding"
    else:
        name = {"cohere": "Cohere", "cohere2": "Cohere2"}[family]
        extra = {"sliding_window": 8} if family == "cohere2" else {}
        model = _tiny_decoder(f"{name}Config", f"{name}ForCausalLM", dtype, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, **_decoder_config(**extra))
        want = "interleaved_rotary_embedding" + ("_float32" if dtype != torch.float32 else "")
    calls = _rewritten_logits_equal(model, ids)
    assert {k: v for k, v in calls.items() if "rotary" in k} == {want: 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("family", ["olmo", "olmo2", "olmo3"])
def test_rotary_with_float32_tables_in_transformers_models(family, dtype):
    """OLMo 1, 2 and 3 keep cos and sin in float32 beside 16-bit queries and keys: the products promote
    to float32, ``.to(q_type)`` rounds the sum once. Each rotation (two layers: four) takes one op, the
    plain one in float32, and the logits stay equal to the bit."""
    name = {"olmo": "Olmo", "olmo2": "Olmo2", "olmo3": "Olmo3"}[family]
    extra = {"sliding_window": 8} if family == "olmo3" else {}
    model = _tiny_decoder(f"{name}Config", f"{name}ForCausalLM", dtype, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, **_decoder_config(**extra))
    calls = _rewritten_logits_equal(model, torch.randint(0, 128, (2, 16)))
    want = "rotary_embedding" + ("_float32_tables" if dtype != torch.float32 else "")
    assert {k: v for k, v in calls.items() if "rotary" in k} == {want: 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_olmo_weightless_layer_norms(dtype):
    """OLMo 1's ``OlmoLayerNorm`` (neither weight nor bias, computed in float32 and cast back): each
    residual add and the norm after it take one op (the post-attention norms, the second layer's input
    norm and the final norm: four in two layers); the first layer's input norm takes the plain op in
    16 bits and stays PyTorch's one LayerNorm kernel in float32. Logits equal to the bit."""
    model = _tiny_decoder("OlmoConfig", "OlmoForCausalLM", dtype, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          **_decoder_config())
    calls = _rewritten_logits_equal(model, torch.randint(0, 128, (2, 16)))
    want = {"add_olmo_layer_norm": 4, **({"olmo_layer_norm": 1} if dtype != torch.float32 else {})}
    assert {k: v for k, v in calls.items() if "norm" in k} == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("family", ["ernie4_5", "ernie4_5_moe"])
def test_interleaved_rotary_with_float32_tables_in_transformers_models(family, dtype):
    """ERNIE 4.5 keeps cos and sin in float32 and casts q and its rotation to float32 before the products
    (``rotate_half(q).float()``): one op for each rotation, logits equal to the bit. In a float32 model
    the casts do nothing but stay in the export IR (``q.float()`` is ``q``, and rotate_half's slices read
    the cast): the plain interleaved op, whose numbers they are."""
    name = {"ernie4_5": "Ernie4_5", "ernie4_5_moe": "Ernie4_5_Moe"}[family]
    extra = {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32} if family == "ernie4_5_moe" else {}
    model = _tiny_decoder(f"{name}Config", f"{name}ForCausalLM", dtype, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, head_dim=16, **_decoder_config(**extra))
    calls = _rewritten_logits_equal(model, torch.randint(0, 128, (2, 16)))
    want = "interleaved_rotary_embedding" + ("_float32_tables" if dtype != torch.float32 else "")
    assert {k: v for k, v in calls.items() if "rotary" in k} == {want: 4}


def olmo_rotary(x, cos, sin):
    """OLMo's ``apply_rotary_pos_emb`` for one of q, k: float32 cos and sin, the sum cast back."""
    return ((x * cos) + (rotate_half(x) * sin)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_rotary_with_float32_tables_forms(dtype):
    torch.manual_seed(0)
    cos, sin = rope_tables(2, 8, 16)
    x = torch.randn(2, 4, 8, 16)
    model, args = Fn(olmo_rotary).eval(), (x.to(dtype), cos[:, None], sin[:, None])
    ep = torch.export.export(model, args)
    for program in (ep, ep.run_decompositions()):
        new = fxkern.apply(program, lib.rules(), verify=True)
        assert library_calls(new) == {"rotary_embedding_float32_tables": 1}
        # the rule's float32 trace, its rotation without the cast, inside the match is not a near-miss
        assert fxkern.explain(program, lib.rules())["rotary_embedding_float32_tables"].near_misses == []
        torch.testing.assert_close(new.module()(*args), model(*args), rtol=0, atol=0)
    # in float32 the cast is gone and it is the plain rotation
    assert replaced(Fn(olmo_rotary), x, cos[:, None], sin[:, None]) == {"rotary_embedding": 1}


def test_ernie_rotary_in_float32_is_the_plain_interleaved_op():
    """ERNIE 4.5's rotation as transformers writes it, in a float32 model: its casts do nothing but stay
    in the IR (``q.float()`` is ``q``, so rotate_half's slices read the cast), and the plain interleaved
    op takes it, in the export IR and in core ATen, equal to eager to the bit."""
    from transformers.models.ernie4_5.modeling_ernie4_5 import rotate_half

    def ernie_rotary(q, cos, sin):
        return ((q.float() * cos) + (rotate_half(q).float() * sin)).to(q.dtype)

    torch.manual_seed(0)
    cos, sin = (t[:, None, :, :8].repeat_interleave(2, dim=-1) for t in rope_tables(2, 8, 16))
    one_op_in_both_irs(ernie_rotary, (torch.randn(2, 4, 8, 16), cos, sin), "interleaved_rotary_embedding")


class _GPTJStyle(nn.Module):
    """GPT-J's attention as written: (B, S, H, D) heads, half-width tables interleaved per call, the
    first rotary_dim columns rotated (``[:, :, :, ::2]`` slices), then the transpose."""

    def __init__(self, rotary_dim):
        super().__init__()
        self.rotary_dim = rotary_dim

    @staticmethod
    def rotate_every_two(x):
        x1 = x[:, :, :, ::2]
        x2 = x[:, :, :, 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, q, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        if self.rotary_dim is None:
            return ((q * cos) + (self.rotate_every_two(q) * sin)).transpose(1, 2)
        q_rot, q_pass = q[:, :, :, :self.rotary_dim], q[:, :, :, self.rotary_dim:]
        q_rot = (q_rot * cos) + (self.rotate_every_two(q_rot) * sin)
        return torch.cat([q_rot, q_pass], dim=-1).transpose(1, 2)


class _GLMStyle(nn.Module):
    """GLM's apply_rotary_pos_emb on a projection's (B, H, S, D) view, rotary_dim = cos.shape[-1]."""

    def forward(self, q_proj, cos, sin):
        b, s, _ = q_proj.shape
        q = q_proj.view(b, s, 4, -1).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cos = cos[..., :cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., :sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        rotary_dim = cos.shape[-1]
        q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
        x1, x2 = q_rot[..., 0::2], q_rot[..., 1::2]
        q_embed = (q_rot * cos) + (torch.stack((-x2, x1), dim=-1).flatten(-2) * sin)
        return torch.cat([q_embed, q_pass], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_interleaved_rotary_forms(dtype):
    torch.manual_seed(0)
    b, s, h, d = 2, 8, 4, 16
    sin, cos = (t[..., :d // 2] for t in interleaved_tables(b, s, d))  # GPT-J's half-width sin, cos
    q = torch.randn(b, s, h, d)
    assert replaced(_GPTJStyle(8), q, sin[..., :4], cos[..., :4], dtype=dtype) == {
        "partial_interleaved_rotary_embedding": 1}
    assert replaced(_GPTJStyle(None), q, sin, cos, dtype=dtype) == {"interleaved_rotary_embedding": 1}
    every_two = lambda x: torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # noqa: E731
    tables_first = Fn(lambda x, c, s: c * x + s * every_two(x))
    it_cos, it_sin = (t.unsqueeze(1) for t in interleaved_tables(b, s, d))
    assert replaced(tables_first, torch.randn(b, h, s, d), it_cos, it_sin, dtype=dtype) == {"interleaved_rotary_embedding": 1}
    glm_cos, glm_sin = rope_tables(b, s, d)  # cat((freqs, freqs)): GLM keeps the first half, interleaved
    assert replaced(_GLMStyle(), torch.randn(b, s, h * 2 * d), glm_cos, glm_sin, dtype=dtype) == {
        "partial_interleaved_rotary_embedding": 1}  # heads of 32, the first 16 columns rotated
    whole = torch.randn(b, s, h * d)  # heads of 16: the whole head (export keeps the empty slice and the cat)
    assert replaced(_GLMStyle(), whole, glm_cos, glm_sin, dtype=dtype) == {"partial_interleaved_rotary_embedding": 1}


@pytest.mark.parametrize("shape", [(2, 8, 4, 24), (1, 1, 2, 24)], ids=["batch", "one position"])
def test_partial_interleaved_rotary_after_run_decompositions(shape):
    """Core ATen (``run_decompositions()``, the IR Torch-TensorRT's is made from) writes ``flatten(-2)``
    as a view to the rotated slice's sizes: the partial and whole-head forms still take one op each,
    traced again at each match's own sizes and rotary_dim (which matched only batch = positions = 1,
    and fell back to the plain op and PyTorch's ``cat``, before 2026-11-27)."""
    b, s, h, d = shape
    cos, sin = (t[:, :, None] for t in interleaved_tables(b, s, 16))
    for rotary_dim, module in ((8, _GPTJStyle(8)), (d, _GPTJStyle(None))):
        c, sn = cos[..., :rotary_dim // 2], sin[..., :rotary_dim // 2]  # GPT-J's half-width tables
        ep = torch.export.export(module, (torch.randn(b, s, h, d), sn[:, :, 0], c[:, :, 0])).run_decompositions()
        new = fxkern.apply(ep, lib.rules(), verify=True)
        args = (torch.randn(b, s, h, d), torch.randn(b, s, rotary_dim // 2), torch.randn(b, s, rotary_dim // 2))
        torch.testing.assert_close(new.module()(*args), ep.module()(*args), rtol=0, atol=0)
        want = "partial_interleaved_rotary_embedding" if rotary_dim < d else "interleaved_rotary_embedding"
        assert library_calls(new) == {want: 1}


def test_interleaved_rotary_refusals():
    """Tables of another dtype than x's (ERNIE 4.5's float32 ones beside 16-bit queries), which the
    kernels do not read, stay PyTorch's."""
    from fxkern.library.interleaved_rotary import interleaved_rotary_embedding

    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    cos, sin = (t[:, None] for t in interleaved_tables(2, 8, 16))
    assert replaced(Fn(interleaved_rotary_embedding), q, cos, sin) == {"interleaved_rotary_embedding": 1}
    ep = torch.export.export(Fn(interleaved_rotary_embedding), (q, cos, sin))  # float32 tables, 16-bit q
    assert not library_calls(fxkern.apply(ep, lib.rules()))


def test_interleaved_rotary_ops_check_their_inputs_and_keep_eager_layout():
    op, partial = lib.op("interleaved_rotary_embedding"), lib.op("partial_interleaved_rotary_embedding")
    cos, sin = (t[:, None] for t in interleaved_tables(2, 8, 16))
    projected = torch.randn(2, 8, 4 * 16).view(2, 8, 4, 16).transpose(1, 2)
    want = lib.interleaved_rotary_embedding(projected, cos, sin)
    got = op(projected, cos, sin)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.stride() == want.stride() != got.contiguous().stride()  # the projection's order, as eager's
    wide = torch.randn(2, 4, 8, 24)
    torch.testing.assert_close(partial(wide, cos, sin, 16), lib.partial_interleaved_rotary_embedding(wide, cos, sin, 16),
                               rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"interleaved_rotary_embedding: x's last axis is 15, odd; .* pair"):
        op(torch.randn(2, 4, 8, 15), cos[..., :15], sin[..., :15])
    with pytest.raises(fxkern.KernelInputError, match=r"partial_interleaved_rotary_embedding: rotary_dim is 15, odd"):
        partial(wide, cos[..., :15], sin[..., :15], 15)
    with pytest.raises(fxkern.KernelInputError, match=r"give cos and sin x's dtype"):
        op(projected.bfloat16(), cos, sin)
    with pytest.raises(fxkern.KernelInputError, match=r"cos \(and sin\) \(2, 1, 8, 16\) does not broadcast onto x"):
        op(torch.randn(2, 4, 8, 8), cos, sin)


def test_interleaved_rotary_eager_path_reads_each_layout_in_place():
    """The CUDA path's plumbing, run on the CPU with the private strided op's reference as the kernel:
    the walk it picks over x, the rotated and pass columns it derives from the tables, and the layout
    it writes give the pattern's numbers and eager's strides."""
    from fxkern.library import interleaved_rotary as ir
    from fxkern.library import rotary

    strided = torch.ops.fxkern_lib._interleaved_rotary_strided
    strided32 = torch.ops.fxkern_lib._interleaved_rotary_strided_float32
    b, s, h, d = 2, 8, 4, 16
    cos, sin = (t[:, None] for t in interleaved_tables(b, s, d))
    layouts = {
        "projected": torch.randn(b, s, h * d).view(b, s, h, d).transpose(1, 2),
        "contiguous": torch.randn(b, h, s, d),
        "GPT-J's (B, S, H, D)": torch.randn(b, h, s, d).transpose(1, 2).contiguous().transpose(1, 2),
        "part of wider heads": torch.randn(b, h, s, d + 8)[..., :d],
    }
    plain = rotary._eager("fxkern_lib::interleaved_rotary_embedding", (strided, strided), ir._output, True)
    partial = rotary._eager("fxkern_lib::partial_interleaved_rotary_embedding", (strided, strided), ir._partial_output,
                            True)
    float32 = rotary._eager("fxkern_lib::interleaved_rotary_embedding_float32", (strided32, strided32),
                            ir._float32_output, True)
    for where, x in layouts.items():
        want = ir.interleaved_rotary_embedding(x, cos, sin)
        got = plain(x, cos, sin)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
        assert all(g == w for g, w, n in zip(got.stride(), want.stride(), got.shape) if n > 1), where
        narrow = (cos[..., :8], sin[..., :8])
        torch.testing.assert_close(partial(x, *narrow, 8), ir.partial_interleaved_rotary_embedding(x, *narrow, 8),
                                   rtol=0, atol=0, msg=where)
        x16, c16, s16 = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
        torch.testing.assert_close(float32(x16, c16, s16), ir.interleaved_rotary_embedding_float32(x16, c16, s16),
                                   rtol=0, atol=0, msg=where)


# ---- DeepSeek-V3's rotation: pairs (2j, 2j + 1) rotated into halves (j, D/2 + j) --------------------------


def deepseek_sliced(q, cos, sin):
    """transformers 5.24's ``apply_rotary_pos_emb_interleave`` for one of q, k."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    return torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)


def deepseek_copied(q, cos, sin):
    """The same before 5.24 (4.x to 5.17): the pairs de-interleaved by a copy, then rotate_half."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return (q * cos) + (rotate_half(q) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("form", [deepseek_sliced, deepseek_copied], ids=["sliced", "copied"])
def test_deinterleaved_rotary_forms(form, dtype):
    """Both of transformers' forms are one op in the export IR and in core ATen, on MLA's queries (the
    rotated part split off wider projected heads) and on contiguous keys, equal to eager to the bit;
    the copied form's rotation is not left to rotary_embedding."""
    torch.manual_seed(0)
    b, s, h, d = 2, 8, 4, 16
    cos, sin = rope_tables(b, s, d)
    q_rot = torch.randn(b, s, h * (24 + d)).view(b, s, h, 24 + d).transpose(1, 2)[..., 24:]
    for x in (q_rot, torch.randn(b, 1, s, d)):
        one_op_in_both_irs(form, (x.to(dtype), cos.to(dtype), sin.to(dtype)), "deinterleaved_rotary_embedding")


def one_op_in_both_irs(fn, args, name):
    """``fn`` exported at ``args`` is the one library op ``name`` in the export IR and in core ATen,
    its output equal to eager's to the bit."""
    model = Fn(fn).eval()
    ep = torch.export.export(model, args)
    for program in (ep, ep.run_decompositions()):
        new = fxkern.apply(program, lib.rules(), verify=True)
        assert library_calls(new) == {name: 1}
        torch.testing.assert_close(new.module()(*args), model(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_deinterleaved_rotary_in_deepseek_v3(dtype):
    """DeepSeek-V3's multi-head latent attention (transformers 5.24) rotates the split-off part of each
    query head and its one shared key head: one op for each (two layers: four), logits equal to the bit."""
    model = _tiny_decoder("DeepseekV3Config", "DeepseekV3ForCausalLM", dtype, moe_intermediate_size=32,
                          n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                          q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**_decoder_config(), "num_key_value_heads": 4})
    calls = _rewritten_logits_equal(model, torch.randint(0, 128, (2, 16)))
    assert {k: v for k, v in calls.items() if "rotary" in k} == {"deinterleaved_rotary_embedding": 4}


def gpt_oss_rotation(q, cos, sin):
    """transformers' GPT-OSS ``apply_rotary_pos_emb`` for one of q, k: its tables are ``freqs``' cos and
    sin (half the head wide), its halves ``torch.chunk``'s."""
    cos, sin = cos[..., : cos.shape[-1] // 2].unsqueeze(1), sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    first_half, second_half = torch.chunk(q, 2, dim=-1)
    return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_chunked_rotary_form(dtype):
    """GPT-OSS's rotation is one op in the export IR and in core ATen, on projected queries (the
    (b, s, h, d) projection's transposed view) and on contiguous keys, equal to eager to the bit."""
    torch.manual_seed(0)
    b, s, h, d = 2, 8, 4, 16
    cos, sin = rope_tables(b, s, d)
    for x in (torch.randn(b, s, h * d).view(b, s, h, d).transpose(1, 2), torch.randn(b, 1, s, d)):
        one_op_in_both_irs(gpt_oss_rotation, (x.to(dtype), cos.to(dtype), sin.to(dtype)), "chunked_rotary_embedding")
    op = lib.op("chunked_rotary_embedding")  # whole tables: rotate_half's numbers; other widths refused
    x = torch.randn(b, h, s, d)
    torch.testing.assert_close(op(x, cos[:, None], sin[:, None]), lib.rotary_embedding(x, cos[:, None], sin[:, None], 8),
                               rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"chunked_rotary_embedding: cos and sin are 5 columns wide"):
        op(x, cos[:, None, :, :5], sin[:, None, :, :5])


def test_deinterleaved_rotary_op_checks_its_operands():
    x = torch.randn(2, 3, 5, 16)
    cos, sin = rope_tables(2, 5, 16)
    op = lib.op("deinterleaved_rotary_embedding")
    for c, s, form in ((cos[:, None, :, :8], sin[:, None, :, :8], deepseek_sliced),
                       (cos[:, None], sin[:, None], deepseek_copied)):
        want = form(x, cos, sin)
        torch.testing.assert_close(op(x, c, s), want, rtol=0, atol=0)
    with pytest.raises(fxkern.KernelInputError, match=r"cos and sin are 5 columns wide; give them half of x's last "
                                                      r"axis, 8 .* or all of it, 16"):
        op(x, cos[:, None, :, :5], sin[:, None, :, :5])
    with pytest.raises(fxkern.KernelInputError, match=r"x's last axis is 15, odd"):
        op(x[..., :15], cos[:, None, :, :7], sin[:, None, :, :7])
    with pytest.raises(fxkern.KernelInputError, match=r"does not broadcast onto x's first half"):
        op(x, cos[:1, None, :4, :8], sin[:1, None, :4, :8])
