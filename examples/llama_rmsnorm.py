"""Replace transformers' Llama RMSNorm with a CUDA kernel, without touching the model.

    python examples/llama_rmsnorm.py [--device cuda]

One rule: the pattern is LlamaRMSNorm.forward written as a function (the
float32 upcast included); the target is a row kernel (one block per row,
warp-shuffle reductions, float accumulation), templated over the dtype.
The script exports a tiny Llama built from a config (no downloads), prints
what matched where, rewrites the program, and checks the logits.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fxkern
from fxkern import DimSize, InputDecl, KernelSpec, Numel, OutputDecl, Reduction, SameAs, ScalarInput

RMSNORM_SRC = r"""
template <typename T>
__global__ void rmsnorm(const T* __restrict__ x, const T* __restrict__ w, float eps, int cols, int w_numel,
                        T* __restrict__ y) {
    __shared__ float partial[32];
    const T* row = x + (long long)blockIdx.x * cols;
    T* out = y + (long long)blockIdx.x * cols;
    float acc = 0.0f;
    // 64-bit column counters: c + blockDim.x must not wrap for rows near 2^31 elements
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = static_cast<float>(row[c]);
        acc += v * v;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < (int)((blockDim.x + 31) / 32) ? partial[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0) partial[0] = rsqrtf(acc / cols + eps);
    }
    __syncthreads();
    float r = partial[0];
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        T normed = static_cast<T>(static_cast<float>(row[c]) * r);   // hidden.to(input_dtype)
        // the weight is declared broadcast: (cols,) as Llama's, or any trailing-axes broadcast of x ((1,),
        // (S, cols)...), read at x's flat index modulo its size
        float wc = static_cast<float>(w[w_numel == cols ? c : ((long long)blockIdx.x * cols + c) % w_numel]);
        out[c] = static_cast<T>(wc * static_cast<float>(normed));
    }
}
"""

RMSNORM = KernelSpec(
    RMSNORM_SRC, "rmsnorm",
    inputs=[InputDecl("hidden_states"), InputDecl("weight", broadcast=True), ScalarInput("eps", float)],
    outputs=[OutputDecl("y", SameAs("hidden_states"))],
    extras=[DimSize("hidden_states", -1), Numel("weight")],
    geometry=Reduction(reduce_dims=(-1,), block_size=256),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
)


def llama_rmsnorm(hidden_states, weight, eps: float):
    """transformers' LlamaRMSNorm.forward, as a function of its inputs."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def tiny_llama(device: str, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    rules = fxkern.RuleSet("llama")
    rule = fxkern.replace(llama_rmsnorm, RMSNORM, name="examples::llama_rmsnorm", rules=rules)
    model = tiny_llama(args.device)
    ids = torch.randint(0, 256, (2, 32), device=args.device)
    ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})

    print(fxkern.explain(ep, rules))
    new = fxkern.apply(ep, rules, verify=True)
    n = sum(1 for node in new.graph.nodes if node.target == rule.op.default)
    other = torch.randint(0, 256, (2, 32), device=args.device)
    with torch.no_grad():
        want = model(other, use_cache=False).logits
        got = new.module()(other, use_cache=False).logits
    err = float((got - want).norm() / want.norm())
    print(f"{n} RMSNorms now run {rule.op.default} on {args.device}; logits rel. err {err:.2e}")
    return 0 if n == 5 and err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
