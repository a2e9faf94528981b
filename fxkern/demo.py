"""``python -m fxkern demo``: the kernel library on a small Llama-style model, end to end.

The model is written here the way transformers writes Llama (RMSNorm with its
float32 upcast, rotary position embeddings, eager attention with a float32
softmax cast back, the SwiGLU MLP) plus a Megatron-style bias+GELU residual block, so the library's rules
meet the graphs real models export, without downloading anything or
depending on transformers. The demo exports the model, shows which rules
replaced what where, checks the rewritten program against the original and,
on a GPU, times eager, rewritten eager, inductor, and inductor behind
``fxkern.backend``.

Part of the CLI (:mod:`fxkern.cli`), so it prints; nothing else in fxkern does.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import fxkern
from fxkern import cli
from fxkern.cli import CliError

DESCRIPTION = (
    "Build a small Llama-style model in code (RMSNorm with the float32 upcast, rotary embeddings, eager "
    "attention with a float32 softmax, SwiGLU MLP, a bias+GELU residual block), export it, apply the kernel "
    "library's rules, print what matched where, check the outputs against the original, and on a "
    "GPU time eager, rewritten, each in a CUDA graph, torch.compile and torch.compile with fxkern.backend."
)


# ---- the model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Sizes of the demo model and of its input batch."""

    hidden: int
    layers: int
    batch: int
    seq: int
    vocab: int
    head_dim: int = 64
    eps: float = 1e-6
    gelu_block: bool = True

    @property
    def heads(self) -> int:
        return max(1, self.hidden // self.head_dim)

    @property
    def kv_heads(self) -> int:  # grouped-query attention, as Llama 2/3
        return self.heads // 2 if self.heads % 2 == 0 else self.heads

    @property
    def intermediate(self) -> int:  # Llama's 8/3 * hidden, rounded up
        multiple = 256 if self.hidden >= 1024 else 32
        return multiple * math.ceil(8 * self.hidden / 3 / multiple)


SIZES: dict[str, Config] = {
    "tiny": Config(hidden=64, layers=2, batch=2, seq=16, vocab=256, head_dim=16),
    "small": Config(hidden=512, layers=2, batch=4, seq=256, vocab=4096),
    "base": Config(hidden=2048, layers=4, batch=8, seq=512, vocab=8192),
}


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, line for line."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, kv_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, kv_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, slen, head_dim)


class Attention(nn.Module):
    """LlamaAttention with transformers' eager attention (float32 softmax, cast back)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = cfg.head_dim, cfg.heads, cfg.kv_heads
        self.scaling = cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        k = repeat_kv(k, self.heads // self.kv_heads)
        v = repeat_kv(v, self.heads // self.kv_heads)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    """LlamaMLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluBlock(nn.Module):
    """A residual GELU block whose linear skips its bias (Megatron's ``skip_bias_add``), so
    bias, GELU and the residual add can run as one kernel: ``x + gelu(fc(norm(x)) + b)``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.fc = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.bias = nn.Parameter(torch.zeros(cfg.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(self.norm(x)) + self.bias, approximate="tanh") + x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = MLP(cfg)
        self.gelu_block = GeluBlock(cfg) if cfg.gelu_block else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        h = h + self.mlp(self.post_attention_layernorm(h))
        if self.gelu_block is not None:
            h = self.gelu_block(h)
        return h


class DemoLM(nn.Module):
    """A Llama-style causal LM: embeddings, decoder layers, final norm, LM head; returns logits."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype)[None], emb.sin().to(h.dtype)[None]
        # 4-d, (1, 1, s, s), as transformers builds its causal masks
        mask = torch.full((s, s), torch.finfo(h.dtype).min, device=h.device, dtype=h.dtype).triu(1)[None, None]
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.lm_head(self.norm(h))


def build_model(cfg: Config, device: torch.device, dtype: torch.dtype, seed: int = 0) -> DemoLM:
    """The demo model with weights scaled so activations stay O(1) through every layer."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = DemoLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:  # norm weights
                p.normal_(1.0, 0.1)
    return model.to(dtype).eval()


# ---- what the CLI runs ----------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ‖rewritten - original‖ / ‖original‖ on the logits: a wrong kernel is off by O(1); rounding
# differences (the kernels round once where eager rounds after every op) stay inside these. For
# scale: at --size small, 4 layers, the model in bfloat16 is 1.9e-2 from itself in float32, in
# float16 4.5e-3; two differently rounded runs may differ by up to about 1.4 times that.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="model and batch preset (default: base on CUDA, tiny on CPU)")
    p.add_argument("--hidden", type=int, help="hidden size (overrides --size)")
    p.add_argument("--layers", type=int, help="decoder layers (overrides --size)")
    p.add_argument("--batch", type=int, help="batch size (overrides --size)")
    p.add_argument("--seq", type=int, help="sequence length (overrides --size)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="parameter and activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", default=None, help="'cuda', 'cuda:1', 'cpu' (default: cuda when visible)")
    p.add_argument("--no-gelu", dest="gelu_block", action="store_false",
                   help="leave out the bias+GELU residual block (a pure Llama)")
    p.add_argument("--rules", metavar="MODULE:ATTR", default=None,
                   help="the rule set to apply (default: fxkern.library:rules)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    p.add_argument("--trt", action="store_true", help="also time Torch-TensorRT (when fxkern.tensorrt says it is usable)")
    p.add_argument("--verbose", "-v", action="store_true", help="print the full explain report, near-misses included")


def resolve(args: argparse.Namespace) -> tuple[Config, torch.device, torch.dtype]:
    """The config, device and dtype the options ask for, with this machine's defaults."""
    cuda = torch.cuda.is_available()
    try:
        device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    except RuntimeError as exc:
        raise CliError(f"--device {args.device!r} is not a device ({exc})") from None
    if device.type == "cuda":
        if not cuda:
            raise CliError(f"--device {args.device}: no CUDA GPU is visible here; run without --device for the CPU path")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type != "cpu":
        raise CliError(f"--device {device}: the demo runs on 'cuda' or 'cpu'")
    size = args.size or ("base" if device.type == "cuda" else "tiny")
    cfg = SIZES[size]
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "batch", "seq") if getattr(args, k) is not None}
    for k, v in overrides.items():
        if v <= 0:
            raise CliError(f"--{k} must be positive, got {v}")
    cfg = replace(cfg, gelu_block=args.gelu_block, **overrides)
    if cfg.hidden % cfg.head_dim:
        raise CliError(f"--hidden {cfg.hidden} is not a multiple of the head size {cfg.head_dim}")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return cfg, device, dtype


class _KernelProgress(logging.Handler):
    """Turns fxkern's log records into progress on stderr: each NVRTC compile as it finishes (they
    run side by side on a cold cache), and a count of the kernel ops registered."""

    def __init__(self, stream: TextIO):
        super().__init__(logging.INFO)
        self.stream, self.registered, self.compiled = stream, 0, 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("fxkern: registered "):
            self.registered += 1
        elif msg.startswith("fxkern: compiled "):
            self.compiled += 1
            line = f"  compiled {self.compiled}: {msg.removeprefix('fxkern: compiled ')}"
            if self.stream.isatty():  # one line, rewritten in place
                print(f"\r{line}\033[K", end="", file=self.stream, flush=True)
            else:
                print(line, file=self.stream, flush=True)


def load_rules_with_progress(load: Callable[[], fxkern.RuleSet], out: TextIO, err: TextIO) -> fxkern.RuleSet:
    """Call ``load`` (which may compile the library's kernels with NVRTC), showing progress on ``err``."""
    from fxkern import compiler

    log = logging.getLogger("fxkern")
    handler = _KernelProgress(err)
    old_level = log.level
    compiles = compiler.stats["compiles"]
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    log.addHandler(handler)
    print("loading the rules: compiling their kernels with NVRTC (first use only; cached on disk)…", file=err, flush=True)
    t0 = time.perf_counter()
    try:
        rules = load()
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        if handler.compiled and err.isatty():
            print(file=err)
    compiled = compiler.stats["compiles"] - compiles
    print(f"rules: {len(rules)} in {rules.name!r}; {handler.registered} kernel ops registered "
          f"({compiled} compiled with NVRTC, the rest from the cache) in {time.perf_counter() - t0:.1f} s", file=out)
    return rules


def match_table(report: fxkern.Report, node_names: frozenset[str] = frozenset()) -> str:
    """One row per rule that matched or nearly did: replaced / candidate sites, and where
    (file:line × count) or why not; then the rules that found nothing. ``node_names`` (the
    graph's) are blanked out of near-miss reasons so that one reason in every layer is one entry."""
    rows, missing = [("rule", "replaced", "candidates", "where, or why not")], []
    ranked = sorted(report.rules.items(), key=lambda kv: (not kv[1].matches, not kv[1].near_misses))
    for name, rr in ranked:
        if not rr.matches and not rr.near_misses:
            missing.append(name)
            continue
        where = Counter(_short(m.location) for m in rr.matches)
        text = ", ".join(f"{loc} ×{n}" for loc, n in where.items())
        if rr.near_misses:
            reasons = Counter(_reason_kind(nm.reason, set(nm.nodes) | node_names) for nm in rr.near_misses)
            shown = [f"{_clip(r, 90)} ×{n}" for r, n in reasons.most_common(2)]
            if len(reasons) > 2:
                shown.append(f"{len(reasons) - 2} other reasons")
            text += ("; " if text else "") + "not replaced: " + "; ".join(shown)
        rows.append((name, str(len(rr.matches)), str(rr.candidates), text))
    table = _table(rows, right=(1, 2))
    if missing:
        table += "\nno match: " + ", ".join(missing)
    return table


def _short(location: str) -> str:
    path, _, line = location.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else location


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _reason_kind(reason: str, names: set[str]) -> str:
    """A near-miss reason without the graph's node names, so the same reason in every layer groups."""
    reason = re.sub(r" at '(\w+)'", lambda m: "" if m.group(1) in names else m.group(0), reason)
    return re.sub(r"'(\w+)'", lambda m: "'…'" if m.group(1) in names else m.group(0), reason)


def _table(rows: list[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


@dataclass
class Check:
    max_abs: float
    rel: float
    tol: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.rel) and self.rel <= self.tol

    def __str__(self) -> str:
        return (f"max abs err {self.max_abs:.2e}, rel err (‖Δ‖/‖ref‖) {self.rel:.2e} "
                f"{'≤' if self.ok else '>'} tol {self.tol:.0e}")


def compare(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> Check:
    d = (got.float() - want.float())
    rel = float(d.norm() / want.float().norm().clamp_min(1e-30))
    return Check(float(d.abs().max()), rel, TOLERANCE[dtype])


GRAPH_ORIGINAL, GRAPH_REWRITTEN = "CUDA graph of the original", "CUDA graph of the rewritten"
# Eager slower than its own CUDA graph by more than this: the host, not the GPU, sets the pace.
HOST_BOUND = 1.1


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 15, inner: int = 3,
                 lead: bool = True) -> float:
    """Median milliseconds per call of ``fn``, timed with CUDA events after warm-up.

    Each sample times ``inner`` back-to-back calls, so the host's launch work overlaps the previous
    kernel as it does in a model, and divides. One untimed call goes first, so the GPU is busy when
    the sample starts and the first timed call's host work overlaps it too: otherwise every sample
    also holds one call's host latency, which tilts a comparison against whichever callable does
    more on the host (a percent or two for 100-300 µs kernels). Where the host is slower than the
    GPU, the timed calls still wait on it. ``lead=False`` starts each sample from an idle GPU.
    benchmarks/ use it with more samples.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            fn()  # untimed: the GPU runs it while the timed calls are launched
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def cuda_graph(fn: Callable[[torch.Tensor], Any], ids: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """``fn(ids)`` captured once in a CUDA graph (after warm-up on a side stream, as capture needs).
    Calling the result replays it on ``ids`` as captured and returns the captured output: the same
    kernels with no Python between them, so its time is the kernels' share of an eager forward."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            fn(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fn(ids)

    def replay(_ids: torch.Tensor) -> Any:
        graph.replay()
        return out

    return replay


def _trt_status() -> tuple[bool, str]:
    """Whether ``fxkern.tensorrt.available()`` says Torch-TensorRT plugins are usable, and why not."""
    status = fxkern.tensorrt.available()
    return bool(status), status.reason


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The demo; returns the exit code (1 when an output disagrees with the original)."""
    out, err = out or sys.stdout, err or sys.stderr
    t_start = time.perf_counter()
    cfg, device, dtype = resolve(args)
    on_gpu = device.type == "cuda"
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name(device)} ({device})", file=out)
    else:
        why = "no CUDA GPU is visible" if not torch.cuda.is_available() else f"--device {device}"
        print(f"device: CPU ({why}): the kernel ops run their PyTorch reference. This path exports, rewrites "
              f"and verifies; it does not time anything.", file=out)
        if not torch.cuda.is_available():
            print("  (on a GPU machine the same command runs the CUDA kernels and times them)", file=out)
    if args.trt:
        trt_ok, trt_why = _trt_status()
        if not trt_ok:
            print(f"--trt: skipped: {trt_why}", file=out)
    print(f"model: Llama-style, hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads "
          f"({cfg.kv_heads} kv), MLP {cfg.intermediate}, vocab {cfg.vocab}"
          f"{', bias+GELU residual block per layer' if cfg.gelu_block else ''}; {dtype}; "
          f"input {cfg.batch}×{cfg.seq} tokens",
          file=out)

    rules = load_rules_with_progress(lambda: cli.load_rules(args.rules, default="library"), out, err)

    model = build_model(cfg, device, dtype)
    n_params_model = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device)
    t0 = time.perf_counter()
    ep = torch.export.export(model, (ids,))
    t_export = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = fxkern.explain(ep, rules)
    new = fxkern.apply(ep, rules)
    t_rewrite = time.perf_counter() - t0
    print(f"exported in {t_export:.1f} s ({n_params_model / 1e6:.1f} M parameters, "
          f"{sum(1 for _ in ep.graph.nodes)} nodes); explain + apply {t_rewrite:.1f} s\n", file=out)
    print("what the rules replaced, and where:", file=out)
    print(match_table(report, frozenset(n.name for n in ep.graph.nodes)), file=out)
    if args.verbose:
        print("\nfull report:\n" + str(report), file=out)
    elif report.near_misses:
        print(f"({len(report.near_misses)} near-misses; --verbose lists each with its reason)", file=out)
    print(file=out)

    fresh = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device=device)
    rewritten = new.module()
    with torch.no_grad():
        want = model(fresh)
        got = rewritten(fresh)
    check = compare(got, want, dtype)
    ok = check.ok
    print(f"verify (rewritten vs original, {dtype}, fresh tokens): logits {check}: "
          f"{'ok' if check.ok else 'MISMATCH'}", file=out)
    if not report.matches:
        print("note: no rule matched, so the rewritten program is the original", file=out)

    if on_gpu:
        ok &= _time_all(args, model, rewritten, rules, fresh, want, dtype, out, err)
    print(f"\n{'ok' if ok else 'FAILED'} in {time.perf_counter() - t_start:.1f} s", file=out)
    return 0 if ok else 1


def _time_all(args: argparse.Namespace, model: nn.Module, rewritten: nn.Module, rules: fxkern.RuleSet,
              ids: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, out: TextIO, err: TextIO) -> bool:
    """Time every variant and check each one's output; prints the table. False on a mismatch."""
    variants: list[tuple[str, Callable[[], Callable[[torch.Tensor], Any]]]] = [
        ("eager (original)", lambda: model),
        ("eager, fxkern rewritten", lambda: rewritten),
        # The same forwards with the host's share gone: what the kernels alone take, and what
        # CUDA graphs alone give the original.
        (GRAPH_ORIGINAL, lambda: cuda_graph(model, ids)),
        (GRAPH_REWRITTEN, lambda: cuda_graph(rewritten, ids)),
    ]
    backend = fxkern.backend(rules)
    if not args.no_compile:
        variants.append(("torch.compile (inductor)", lambda: torch.compile(model)))
        variants.append(("torch.compile + fxkern.backend", lambda: torch.compile(model, backend=backend)))
    if args.trt:
        trt_ok, _ = _trt_status()
        if trt_ok:
            variants.append(("Torch-TensorRT + fxkern", lambda: _trt_compile(model, rules, ids, dtype)))
    rows: list[tuple[str, ...]] = [("variant", "ms/forward", "vs eager", "compile s", "rel err", "note")]
    ok, base, times = True, None, {}
    print("timing (CUDA events, warm-up, median):", file=err, flush=True)
    for name, make in variants:
        print(f"  {name}…", file=err, flush=True)
        torch._dynamo.reset()
        try:
            t0 = time.perf_counter()
            fn = make()
            with torch.no_grad():
                got = fn(ids)
                torch.cuda.synchronize()
                t_compile = time.perf_counter() - t0
                ms = cuda_time_ms(lambda f=fn: f(ids))
        except Exception as exc:  # noqa: BLE001  (one variant failing must not hide the others)
            rows.append((name, "failed", "", "", "", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"))
            ok = False
            continue
        check = compare(got, want, dtype)
        ok &= check.ok
        base = base or ms
        compiled = "compile" in name or "TensorRT" in name
        rows.append((name, f"{ms:.3f}", f"{base / ms:.2f}x", f"{t_compile:.1f}" if compiled else "",
                     f"{check.rel:.1e}", "" if check.ok else f"> tol {check.tol:.0e}"))
        times[name] = ms
    if not any(r[-1] for r in rows[1:]):  # no notes: drop the column
        rows = [r[:-1] for r in rows]
    print("\n" + _table(rows, right=(1, 2, 3, 4)), file=out)
    eager, graphed = times.get("eager, fxkern rewritten"), times.get(GRAPH_REWRITTEN)
    if eager and graphed and eager > HOST_BOUND * graphed:
        print(f"the rewritten forward waits on the host here: its kernels alone (the CUDA graph row) take "
              f"{graphed:.3f} ms, {eager / graphed:.2f}x less than eager, where Python issues each op; a faster "
              f"host, a CUDA graph or torch.compile removes that share (docs/library.md, \"Eager and the host\")",
              file=out)
    if backend.reports:
        replaced = Counter(m.rule for r in backend.reports for m in r.matches)
        if replaced:
            print(f"fxkern.backend replaced {sum(replaced.values())} subgraphs in inductor's graphs ("
                  + ", ".join(f"{k} ×{v}" for k, v in replaced.items()) + ")", file=out)
        else:
            print("fxkern.backend left inductor's graphs as they were: the library's rules step aside inside "
                  "inductor, whose own fused kernels are as fast there (docs/library.md, \"Inside torch.compile\"); "
                  "your own rules still run there", file=out)
    return ok


def _trt_compile(model: nn.Module, rules: fxkern.RuleSet, ids: torch.Tensor, dtype: torch.dtype) -> Any:
    import torch_tensorrt

    from fxkern import tensorrt as fx_trt

    with fx_trt.using(rules):  # these rules for this compile only; the process-wide choice stays
        return torch_tensorrt.compile(model, ir="dynamo", inputs=[ids], enabled_precisions={dtype},
                                      min_block_size=1)
