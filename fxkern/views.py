"""Between two matching passes: views moved above the elementwise op whose result they view.

A model may change a tensor's shape between a residual add and the norm that reads the sum.
transformers' OPT writes ``(residual + h).view(shape)`` and then the next layer's LayerNorm, and
``h.reshape(-1, D)`` between the attention block's add and ``final_layer_norm``. An add-and-norm
rule sees add -> view -> norm there and matches none of them.

A view of ``a + b``, where a and b have the sum's shape, is ``view(a) + view(b)``. Moved above the
add, the view no longer stands between the add and the norm. A view is moved only when

* it keeps the last axis, the axis row ops (norms, softmax) reduce: a view that splits or joins
  the last axis is left where the model wrote it;
* it alone reads the op's result (an op with other readers would then run twice);
* the operands can be viewed so without a copy, and the moved result has the view's shape and
  strides (the dtype it keeps: a view changes none);
* nothing between the op and the view writes in place;
* neither the view nor the op is in a match the graph has as the model wrote it (the rewrite
  matches, moves views, and matches again: ``rewrite._analysed``). GPT-2's Conv1D views each
  ``gelu_new``'s result, whose last op is a mul; a moved view would cut that GELU's pattern in two.

Patterns are not moved so: a user's pattern that views a sum itself matches in the first pass, and
its nodes then stay where they are.

A view that was a graph output is then the moved op's node, of another name: :func:`move_views`
returns the names, which an ExportedProgram's output specs take.

Where no rule then matches, the graph computes the same values with one more view (a view of
each operand instead of one of the sum), which costs no kernel.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxkern.graphs import mutates, run_on

aten = torch.ops.aten

# Elementwise ops of two operands: a residual stream's adds, and a scaled one's (Granite's
# ``residual + h * multiplier`` ends in an add, as does every pre-norm block).
ELEMENTWISE = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor})
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


def _same(a: Any, b: Any) -> bool:
    """Sizes or strides equal without guessing at symbols (no guard is added)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _writes_between(first: fx.Node, last: fx.Node) -> bool:
    node = first.next
    while node is not last:
        if mutates(node):
            return True
        node = node.next
    return False


def _movable(view: fx.Node, taken: Collection[fx.Node] = ()) -> Optional[Tuple[Dict[fx.Node, torch.Tensor], torch.Tensor]]:
    """What moving ``view`` above the op it views takes (the operands' views' values and the moved
    op's), or None when it is not to be moved (``taken``: nodes of matches, left where they are)."""
    if view.op != "call_function" or view.target not in VIEWS or view.kwargs or len(view.args) != 2:
        return None
    op = view.args[0]
    if not isinstance(op, fx.Node) or op.op != "call_function" or op.target not in ELEMENTWISE:
        return None
    if view in taken or op in taken:
        return None
    if len(op.users) != 1:
        return None
    before, after = op.meta.get("val"), view.meta.get("val")
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    if before.dim() == 0 or after.dim() == 0 or not statically_known_true(before.shape[-1] == after.shape[-1]):
        return None
    operands = [a for a in op.args[:2] if isinstance(a, fx.Node)]
    for a in operands:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or not _same(val.shape, before.shape):
            return None  # a broadcast operand: its view is not the sum's
    if not operands or _writes_between(op, view):
        return None
    try:  # aten.view, not reshape: it raises where the operand would have to be copied
        viewed = {a: run_on(aten.view.default, (a, view.args[1])) for a in operands}
        moved = run_on(op.target, [viewed.get(a, a) if isinstance(a, fx.Node) else a for a in op.args], op.kwargs)
    except Exception:  # noqa: BLE001 - no view without a copy, or sizes the fake tensors refuse
        return None
    if not _same(moved.shape, after.shape) or not _same(moved.stride(), after.stride()):
        return None  # a transposed operand's sum is laid out as the other operand: its view is not
    return viewed, moved


def movable(graph: fx.Graph, taken: Collection[fx.Node] = ()) -> List[fx.Node]:
    """The views :func:`move_views` would move; ``taken``: the nodes of matches, which stay."""
    return [n for n in graph.nodes if n.target in VIEWS and _movable(n, taken) is not None]


def move_views(graph: fx.Graph, taken: Collection[fx.Node] = ()) -> Dict[str, str]:
    """Move each movable view of ``graph`` above the op it views, in place (``taken``: the nodes of
    matches, which stay). Returns each moved view's name and the name of the node that now computes
    its value. The new nodes take the view's place in the graph; the moved op keeps the old op's
    source location, and the new nodes are named for the two they replace (``add_5_view_3``; an
    operand's view ``view_3_x``), for the reports: ``explain`` named them ``add_tensor``."""
    moved: Dict[str, str] = {}
    for view in [n for n in graph.nodes if n.target in VIEWS]:
        found = _movable(view, taken)  # one at a time: an earlier move may have changed what it reads
        if found is None:
            continue
        viewed, value = found
        op = view.args[0]
        with graph.inserting_before(view):
            new_args = []
            views: Dict[fx.Node, fx.Node] = {}
            for a in op.args:
                if isinstance(a, fx.Node):
                    if a not in views:
                        views[a] = graph.create_node("call_function", view.target, (a, view.args[1]),
                                                     name=f"{view.name}_{a.name}")
                        _meta(views[a], view, viewed[a])
                    a = views[a]
                new_args.append(a)
            new = graph.create_node("call_function", op.target, tuple(new_args), dict(op.kwargs),
                                    name=f"{op.name}_{view.name}")
            _meta(new, op, value)
        view.replace_all_uses_with(new)
        moved[view.name] = new.name
        graph.erase_node(view)
        graph.erase_node(op)
    return moved


def _meta(new: fx.Node, like: fx.Node, val: torch.Tensor) -> None:
    """``like``'s source location and module path, and the value it now computes."""
    new.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
    new.meta["val"] = val
