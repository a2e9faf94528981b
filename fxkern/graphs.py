"""Facts about fx graphs that the passes before and during matching share: which ops write their
inputs in place, and what an op would give a node's traced values."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor


def writes_input(target: Any) -> bool:
    """True for an op whose schema writes one of its inputs."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def mutates(node: fx.Node) -> bool:
    """True for an op that writes one of its inputs in place (``add_``, ``copy_``...), and for a
    higher-order op (a ``torch.no_grad()`` block, a ``torch.cond``) whose subgraph holds one: its
    schema says nothing of what the subgraph writes."""
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return any(mutates(n) for sub in subgraphs(node) for n in sub.graph.nodes)
    return writes_input(node.target)


def subgraphs(node: fx.Node) -> List[fx.GraphModule]:
    """The GraphModules a higher-order op's call runs (its ``get_attr`` arguments)."""
    owner = node.graph.owning_module
    found = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr" and owner is not None:
            sub = functools.reduce(getattr, a.target.split("."), owner)
            if isinstance(sub, fx.GraphModule):
                found.append(sub)
    return found


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
