"""The decomposition table Torch-TensorRT lowers with, for tracing patterns in its IR.

Torch-TensorRT runs ``run_decompositions(get_decompositions())`` (or
``aot_export_joint_simple`` with that table) before its lowering passes, so
the graph our pass sees has e.g. ``rsqrt`` as ``div(1, sqrt)`` and ``silu``
as ``x * sigmoid(x)``. A pattern must be traced through the same table to
match. When Torch-TensorRT is importable its own table is used; otherwise
this module rebuilds it from the parts its documentation and source name:
PyTorch's decompositions for a fixed set of ops, every CompositeImplicitAutograd
ATen op minus a disabled set, and Torch-TensorRT's own rewrites (written
here from their documented behaviour).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any, Callable, Dict

import torch

log = logging.getLogger("fxkern")
aten = torch.ops.aten

# Ops Torch-TensorRT takes PyTorch's decomposition for (the part that matters for fused patterns).
_TORCH_ENABLED = [
    "addcdiv", "addcmul", "addr", "baddbmm", "celu", "detach", "empty_like", "expand_as", "fill",
    "frac", "hardshrink", "hardswish", "hardtanh", "heaviside", "lerp", "logaddexp", "logit",
    "logsumexp.default", "masked_fill", "mish", "nan_to_num", "narrow", "new_empty", "new_full",
    "new_ones", "new_zeros", "norm", "ones", "ones_like", "_reshape_alias", "rsub", "sgn",
    "softshrink", "stack", "std", "t", "threshold", "transpose.int", "tril.default", "triu.default",
    "unbind", "unfold", "var", "var_mean", "xlogy", "zero", "zeros", "zeros_like", "clamp_min",
    "clamp_max", "linalg_vector_norm", "leaky_relu_",
]
# CompositeImplicitAutograd ops Torch-TensorRT keeps whole (it has converters for them).
_TORCH_DISABLED = [
    "_softmax.default", "upsample_nearest1d.vec", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
    "upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_trilinear3d.vec",
    "upsample_bicubic2d.vec", "linear.default", "matmul.default", "repeat",
]


def _resolve(name: str) -> list:
    """``"op"`` is every overload of ``aten.op``; ``"op.overload"`` is that one."""
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    if packet is None:
        return []
    if overload:
        op = getattr(packet, overload, None)
        return [op] if op is not None else []
    return [getattr(packet, o) for o in packet.overloads()]


def _own() -> Dict[Any, Callable[..., Any]]:
    """Torch-TensorRT's own rewrites that change what a pattern traces to."""

    def rsqrt(x):
        return torch.reciprocal(torch.sqrt(x))

    def reciprocal(x):
        return torch.div(1, x)

    def silu(x):
        return x * torch.sigmoid(x)

    def view(x, size):
        return aten._reshape_copy.default(x, size)

    def unsafe_view(x, size):
        return torch.reshape(x, size)

    def identity(x):
        return x

    table: Dict[Any, Callable[..., Any]] = {
        aten.rsqrt.default: rsqrt,
        aten.reciprocal.default: reciprocal,
        aten.silu.default: silu,
        aten.silu_.default: silu,
        aten.view.default: view,
        aten._unsafe_view.default: unsafe_view,
        aten.alias.default: identity,
        aten.lift_fresh_copy.default: identity,
    }
    return table


@functools.lru_cache(maxsize=1)
def reproduced_table() -> Dict[Any, Callable[..., Any]]:
    """fxkern's rebuild of Torch-TensorRT's default table (no experimental decompositions)."""
    from torch._decomp import get_decompositions
    from torch._export.utils import _collect_all_valid_cia_ops_for_aten_namespace, _get_decomp_for_cia

    enabled = [op for name in _TORCH_ENABLED for op in _resolve(name)]
    disabled = {op for name in _TORCH_DISABLED for op in _resolve(name)}
    cia = {op: _get_decomp_for_cia(op) for op in _collect_all_valid_cia_ops_for_aten_namespace()
           if op not in disabled}
    return {**get_decompositions(enabled), **cia, **_own()}


def table() -> Dict[Any, Callable[..., Any]]:
    """Torch-TensorRT's own table when it is importable, else :func:`reproduced_table`."""
    if importlib.util.find_spec("torch_tensorrt") is None:
        return reproduced_table()
    try:
        from torch_tensorrt.dynamo.lowering import get_decompositions
    except ImportError as exc:  # installed, but without its dynamo frontend, or broken
        log.warning("fxkern: tracing patterns with fxkern's rebuild of Torch-TensorRT's decompositions: "
                    "torch_tensorrt.dynamo.lowering does not import (%s)", exc)
        return reproduced_table()
    return get_decompositions()
