"""Facts about fx graphs that the passes before and during matching share: which ops write their
inputs in place, and what an op would give a node's traced values."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor


def writes_input(target: Any) -> bool:
    """True for an op whose schema writes one of its inputs."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def mutates(node: fx.Node) -> bool:
    """True for an op that writes one of its inputs in place (``add_``, ``copy_``...)."""
    return node.op == "call_function" and writes_input(node.target)


def run_on_vals(fn: Any, node: fx.Node, autocast: bool = True) -> Any:
    """``fn`` run on ``node``'s arguments' traced values (fake tensors: nothing is computed), to ask
    what an op would give them; ``autocast=False`` asks it with autocast off. Raises what ``fn`` raises."""
    return run_on(fn, node.args, node.kwargs, autocast)


def run_on(fn: Any, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None, autocast: bool = True) -> Any:
    """``fn`` run on ``args`` with each node replaced by its traced value, as :func:`run_on_vals`."""
    as_val = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    args, kwargs = torch.utils._pytree.tree_map(as_val, (tuple(args), dict(kwargs or {})))
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    # the values' own mode first: inside a compile, the tracing context's may be another one
    # (aot_autograd's graphs under dynamo's context: "Mixing fake modes")
    mode = next((v.fake_mode for v in leaves if isinstance(v, FakeTensor)), None) or detect_fake_mode(leaves)
    with mode or torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True), \
            contextlib.nullcontext() if autocast else torch._C._DisableAutocast():
        return fn(*args, **kwargs)
