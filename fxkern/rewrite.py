"""The pass: find every rule's matches, keep the safe ones, resolve overlaps, rewrite.

``apply`` returns a rewritten copy (ExportedProgram or GraphModule);
``explain`` runs the same analysis and returns a :class:`Report` instead.
A match is replaced only when

* no intermediate value is used outside it (value-preserving ops at its
  input edge excepted: they stay for their other users);
* contracting it to one node creates no cycle (checked by a forward walk
  bounded by graph order; :func:`creates_cycle_networkx` is the reference);
* the rule's filter accepts it;
* the op, run on the matched inputs' fake values, accepts them and returns
  exactly the shapes and dtypes the match computed.

Overlaps go to the rule with the lower priority (default: the order rules
were added), then the larger match, then the earlier anchor in the graph.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import heapq
import logging
import operator
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.fx as fx

from fxkern import views
from fxkern.errors import FxkernError
from fxkern.graphs import mutates, run_on_vals, writes_input
from fxkern.matcher import Failure, Match, Matcher, index_graph
from fxkern.patterns import is_inert, quiet_fake_errors
from fxkern.rules import Rule, RuleSet, default_rules, trace_together

log = logging.getLogger("fxkern")

EXPORT_IRS = ("export", "core_aten")


class VerificationError(FxkernError, AssertionError):
    """``apply(..., verify=True)`` found an output that changed."""


# ---- the report ------------------------------------------------------------------


@dataclass
class MatchInfo:
    rule: str
    nodes: List[str]
    location: str


@dataclass
class NearMiss:
    rule: str
    nodes: List[str]
    reason: str


@dataclass
class RuleReport:
    """One rule's part of a report: what it replaced, its near-misses, how many candidate sites (nodes
    with the pattern's last op) the graph has, and for a rule with neither matches nor near-misses
    the walk that got furthest (``closest``), which says where the model differs from the pattern."""

    matches: List[MatchInfo] = field(default_factory=list)
    near_misses: List[NearMiss] = field(default_factory=list)
    candidates: int = 0
    # with neither: the walk that got furthest, too short a way in to count as a near-miss
    closest: Optional[NearMiss] = None


@dataclass
class Report:
    """What ``apply`` would replace, and what it would not, and why."""

    matches: List[MatchInfo] = field(default_factory=list)
    near_misses: List[NearMiss] = field(default_factory=list)
    rules: Dict[str, RuleReport] = field(default_factory=dict)

    def __getitem__(self, rule_name: str) -> RuleReport:
        try:
            return self.rules[rule_name]
        except KeyError:
            raise KeyError(f"no rule named {rule_name!r} in this report; its rules: {', '.join(self.rules) or 'none'}") from None

    def __contains__(self, rule_name: object) -> bool:
        return rule_name in self.rules

    def __iter__(self):
        """The rule names, in the rule set's order (``for name in report: report[name]``)."""
        return iter(self.rules)

    def __str__(self) -> str:
        lines = []
        for name, rr in self.rules.items():
            lines.append(f"rule {name}: {len(rr.matches)} replaced of {rr.candidates} candidate sites")
            for m in rr.matches:
                lines.append(f"  match      {', '.join(m.nodes)}  [{m.location}]")
            for nm in rr.near_misses:
                lines.append(f"  near-miss  {', '.join(nm.nodes) or '-'}: {nm.reason}")
            if rr.candidates and not rr.matches and not rr.near_misses:
                lines.append(f"  (the pattern's last op appears {rr.candidates}x, but none of them came close to the "
                             f"pattern's other ops: the model may compute it another way; see troubleshooting.md, near-misses)")
                if rr.closest is not None:
                    lines.append(f"  closest    {', '.join(rr.closest.nodes) or '-'}: {rr.closest.reason}")
        return "\n".join(lines) if lines else (
            "no rules: pass a RuleSet (fxkern.library.rules() is fxkern's library), or fill the default set "
            "with fxkern.replace; a fxkern.region block counts once it has run outside torch.compile")


# ---- analysis -------------------------------------------------------------------


@dataclass
class _Candidate:
    rule: Rule
    match: Match
    fake_outputs: Tuple[Any, ...]


def _location(node: fx.Node, seen: Optional[Dict[str, str]] = None) -> str:
    """The last file:line of ``node``'s stack trace; ``seen`` keeps those found by trace (a model's
    layers share theirs, and the search was 1% of the pass)."""
    trace = node.meta.get("stack_trace") or ""
    if seen is not None and trace in seen:
        return seen[trace]
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    where = f"{found[-1][0]}:{found[-1][1]}" if found else "?"
    if seen is not None:
        seen[trace] = where
    return where


def _positions(graph: fx.Graph) -> Dict[fx.Node, float]:
    return {n: float(i) for i, n in enumerate(graph.nodes)}


@dataclass(frozen=True)
class HeldOutputs:
    """A graph's outputs whose strides what reads them relies on: a torch.cond branch's (the other
    branch returns the old ones), a no_grad block's that a view after the block takes, and under
    inductor those it lays out as their node's value says (a branch's, a value saved for the
    backward). A match whose result would leave the graph there in another layout is refused."""

    free: FrozenSet[int]  # the positions that may change layout all the same
    what: str  # "the torch.cond branch's output"
    why: str  # what relies on the old strides
    whole: bool = False  # strides compared whole, dims of size 1 too (torch.cond compares them so)
    direct: bool = False  # only the op's own results: inductor lays later values out as their nodes say


@dataclass(frozen=True)
class _Where:
    """Where a graph runs: the device types whose autocast is on, which of its outputs must keep
    their strides (None: none), and whether it is the program's own graph (regions are found there
    only: a block's nodes inside a subgraph are part of a run)."""

    autocast: Tuple[str, ...] = ()
    held: Optional[HeldOutputs] = None
    top: bool = True


def _autocast_state(node: fx.Node, state: Tuple[str, ...]) -> Tuple[str, ...]:
    """``state`` after ``node`` when it enters an autocast context (``wrap_with_autocast`` or an
    inline ``_enter_autocast``, as export leaves a block holding a torch.cond)."""
    args = list(node.args) + [None, None, None]
    device = args[0] if args[0] is not None else node.kwargs.get("device_type")
    enabled = args[2] if args[2] is not None else node.kwargs.get("enabled", True)
    return tuple(sorted(({device} | set(state)) if enabled else (set(state) - {device})))


class _Facts:
    """What the safety checks ask of one graph, computed once per analysis: node positions, where
    the in-place ops are, and the fake-run outcomes and metadata keys already seen."""

    def __init__(self, graph: fx.Graph, by_target: Dict[Any, List[fx.Node]], where: _Where = _Where()):
        self.pos = _positions(graph)
        self.where = where
        self.autocast: Dict[fx.Node, Tuple[str, ...]] = {}  # by node, where inline autocast blocks change it
        if torch.amp.autocast_mode._enter_autocast in by_target:
            state, stack = where.autocast, []
            for n in graph.nodes:
                if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
                    stack.append(state)
                    state = _autocast_state(n, state)
                elif n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast and stack:
                    state = stack.pop()
                self.autocast[n] = state
        writers = sorted((n for t, ns in by_target.items() if writes_input(t) or isinstance(t, torch._ops.HigherOrderOperator)
                          for n in ns if mutates(n)), key=self.pos.__getitem__)
        self.writers = writers
        self.writer_pos = [self.pos[n] for n in writers]
        self.fake_runs: Dict[Any, Any] = {}
        self.meta_keys: Dict[fx.Node, int] = {}
        self.meta_ids: Dict[Any, int] = {}  # each distinct metadata key, numbered
        # the layout check's steps, by node and the strides of its inputs that changed, and the
        # (node, strides) whose every later node was checked: matches in a model of one layout
        # change every later node the same way, run once
        self.layouts: Dict[Any, Tuple[Any, Optional[str]]] = {}
        self.layouts_done: Set[Any] = set()
        self.anchor_dtypes: Dict[Any, List[Optional[torch.dtype]]] = {}
        self._by_target, self._upcasts, self._downcasts, self._dtypes_at = by_target, None, None, {}
        self.held_at: Dict[fx.Node, List[int]] = {}  # the held outputs' positions, by node
        if where.held is not None:
            for i, n in enumerate(torch.utils._pytree.tree_leaves(graph.find_nodes(op="output")[0].args[0])):
                if isinstance(n, fx.Node) and i not in where.held.free:
                    self.held_at.setdefault(n, []).append(i)

    def upcasts(self) -> bool:
        """Whether the graph casts a 16-bit float value (looked at once, on the casts alone)."""
        if self._upcasts is None:
            self._upcasts = any(isinstance(v := a.meta.get("val"), torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
                                for t in _CASTS for n in self._by_target.get(t, ()) for a in n.all_input_nodes)
        return self._upcasts

    def downcasts(self) -> bool:
        """Whether the graph casts a value to a 16-bit float (looked at once, on the casts alone)."""
        if self._downcasts is None:
            self._downcasts = any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16)
                                  for t in _CASTS for n in self._by_target.get(t, ()))
        return self._downcasts

    def dtypes_at(self, target: Any) -> List[torch.dtype]:
        """The floating dtypes of the nodes calling ``target``, those a float32 one upcasts from, and
        those it is cast down to (below); once per target: rules anchored on one op (a ``mul``) share it."""
        found = self._dtypes_at.get(target)
        if found is None:
            found = self._dtypes_at[target] = []
            upcasts, downcasts = self.upcasts(), self.downcasts()
            seen = set()  # a dtype met again adds nothing, but at a float32 node the casts near it may
            for n in self._by_target.get(target, ()):
                val = n.meta.get("val")
                d = val.dtype if isinstance(val, torch.Tensor) else torch.float32
                if d in seen and not (d == torch.float32 and (upcasts or downcasts)):
                    continue
                seen.add(d)
                if d.is_floating_point and d not in found:
                    found.append(d)
                if upcasts and d == torch.float32:  # also the dtype upcast on the way in
                    found.extend(up for up in _upcast_from(n) if up not in found)
                if downcasts and d == torch.float32:  # and the one it is cast back to
                    found.extend(down for down in _downcast_to(n) if down not in found)
        return found

    def autocast_at(self, node: fx.Node) -> Tuple[str, ...]:
        """The device types whose autocast is on where ``node`` runs."""
        return self.autocast.get(node, self.where.autocast)

    def writer_between(self, first: float, last: float) -> Optional[fx.Node]:
        """An in-place op at a position in [first, last], or None."""
        i = bisect.bisect_left(self.writer_pos, first)
        return self.writers[i] if i < len(self.writers) and self.writer_pos[i] <= last else None

    def meta_key(self, v: Any) -> Any:
        """:func:`_meta_key`, a node's as the number of its distinct key: the fake runs' cache then
        hashes a few numbers a match, not shapes, strides and devices (half a cached lookup's cost)."""
        if not isinstance(v, fx.Node):
            return _meta_key(v)
        key = self.meta_keys.get(v)
        if key is None:
            key = self.meta_keys[v] = self.meta_ids.setdefault(_meta_key(v), len(self.meta_ids))
        return key


def _hazards(match: Match, facts: _Facts) -> Optional[str]:
    """Reasons a contraction is unsafe beyond data flow: a parameter bound inside the match,
    or an in-place op that the replacement would lose or be moved past."""
    inside = match.node_set
    for name, v in match.bindings.items():
        if isinstance(v, fx.Node) and v in inside:
            return f"parameter {name!r} binds to {v.name!r}, a value the match itself computes"
    pos = facts.pos
    # From the first copy the op reads through (it reads the copy's source where it runs) or matched
    # node, to the last matched node (a later output of a multi-output match comes after the anchor)
    first = min(map(pos.__getitem__, (*inside, *match.copies)))
    node = facts.writer_between(first, max(map(pos.__getitem__, inside)))
    if node is not None:
        where = "the matched nodes" if pos[node] > min(pos[n] for n in inside) else "a copy the match reads and the match"
        return f"the in-place op {node.name!r} ({node.target}) runs between {where}"
    for n in match.nodes if facts.autocast or facts.where.autocast else ():  # most graphs: no autocast anywhere
        devices = facts.autocast_at(n)
        if devices and _autocast_changes(n):
            return (f"inside a torch.autocast({', '.join(map(repr, devices))}) block, {n.name!r} ({n.target}) runs in "
                    f"another dtype than written, and the op would run as written: move the block out of the autocast "
                    f"region, or export with autocast applied (ep.run_decompositions() writes its casts out)")
    return None


def _autocast_changes(node: fx.Node) -> bool:
    """True when ``node``'s traced output dtype, traced under autocast, differs from the one the
    op gives its inputs without autocast (an op on the float32 list given float32 inputs, say, is
    left as written). Every op is run, not only those with an autocast kernel: a composite op
    (einsum, tensordot) has none, and the matmul it becomes does (found by a review)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    try:
        plain = run_on_vals(node.target, node, autocast=False)
    except Exception:  # noqa: BLE001 - cannot tell: count it as changed
        return True
    traced = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    plain = torch.utils._pytree.tree_leaves(plain)
    return len(traced) != len(plain) or any(
        isinstance(a, torch.Tensor) and (not isinstance(b, torch.Tensor) or a.dtype != b.dtype) for a, b in zip(traced, plain))


def _placement(match: Match, pos: Dict[fx.Node, float]) -> Optional[str]:
    """The op call goes before the first use of any output; every input must exist by then."""
    inside = match.node_set
    point = min([match.anchor] + [u for o in match.outputs for u in o.users if u not in inside], key=pos.__getitem__)
    late = next((v for v in match.bindings.values() if isinstance(v, fx.Node) and pos[v] >= pos[point]), None)
    if late is not None:
        return (f"the op would run before {point.name!r} uses one of its outputs, but its input {late.name!r} is "
                f"computed after that (the graph would need reordering)")
    return None


def _escaping(match: Match) -> Optional[str]:
    inside = match.node_set
    outputs = set(match.outputs)
    for n in match.nodes:
        if n in outputs:
            continue
        for u in n.users:
            if u not in inside and not is_inert(u):
                return f"intermediate {n.name!r} is also used by {u.name!r} outside the match"
    return None


def creates_cycle(match_nodes: Set[fx.Node], pos: Dict[fx.Node, float]) -> Optional[fx.Node]:
    """A node outside the match that lies on a path from the match back into it, or None.

    Walks forward from the match's outside users, never past the last
    matched node in graph order, so the cost is bounded by the span of
    the match.
    """
    last = max(map(pos.__getitem__, match_nodes))
    frontier = deque(u for n in match_nodes for u in n.users if u not in match_nodes and pos[u] < last)
    seen: Set[fx.Node] = set()
    while frontier:
        n = frontier.popleft()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in match_nodes:
                return n
            if pos[u] < last and u not in seen:
                frontier.append(u)
    return None


def creates_cycle_networkx(graph: fx.Graph, match_nodes: Set[fx.Node]) -> bool:
    """Reference check with networkx: contract the match to one node and look for a cycle."""
    import networkx as nx

    g = nx.DiGraph()
    rep = "__match__"
    name = lambda n: rep if n in match_nodes else n  # noqa: E731
    for n in graph.nodes:
        g.add_node(name(n))
        for u in n.users:
            a, b = name(n), name(u)
            if a != b:
                g.add_edge(a, b)
    return not nx.is_directed_acyclic_graph(g)


def _meta_key(v: Any) -> Any:
    """What a fake run depends on: a tensor's strides too (a meta_fn refusing a transposed input, or
    laying its output out as its input, was asked once for a contiguous input of one shape and its
    answer reused for the transposed one: the rewritten program failed when traced again)."""
    if isinstance(v, fx.Node):
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            layout = (val.shape, val.stride())  # torch.Size hashes as the tuple it is
            try:
                hash(layout)
            except TypeError:  # symbolic sizes
                layout = tuple(tuple(map(str, t)) for t in layout)
            return ("T", layout, val.dtype, val.device)
        return ("N", type(val).__name__)
    return ("S", type(v).__name__, v)


def _fake_run(rule: Rule, match: Match, facts: _Facts) -> Tuple[Optional[Tuple[Any, ...]], Optional[str]]:
    """Run the op's fake impl on the matched inputs; None and a reason when it refuses or disagrees.

    Outcomes are cached by the inputs' and outputs' metadata: a model's layers repeat them.
    """
    unbound = [p for p in rule.arg_params if p not in match.bindings]
    if unbound:  # a scalar the walk never met as a literal (a view's size, inside a list): explain crashed
        return None, (f"the match binds no value for the pattern's parameter(s) {unbound}; a scalar used inside a list "
                      f"argument (a view's size) is not captured: pass it as a tensor, or make it a constant")
    meta_key, bindings = facts.meta_key, match.bindings
    key = (rule, tuple([meta_key(bindings[p]) for p in rule.arg_params]), tuple([meta_key(o) for o in match.outputs]))
    result = facts.fake_runs.get(key)
    if result is None:
        result = facts.fake_runs[key] = _fake_run_uncached(rule, match)
    return result


def _refake(args: List[Any]) -> List[Any]:
    """Fakes of one mode for values of several, when their sizes are static (else unchanged)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(not isinstance(d, int) for t in tensors for d in t.shape):
        return args
    mode = torch._subclasses.FakeTensorMode()
    with mode:  # on the values' own devices, so a meta_fn that checks the device sees the real one
        return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                if isinstance(a, torch.Tensor) else a for a in args]


def _fake_run_uncached(rule: Rule, match: Match) -> Tuple[Optional[Tuple[Any, ...]], Optional[str]]:
    args = []
    for pname in rule.arg_params:
        v = match.bindings[pname]
        if isinstance(v, fx.Node):
            val = v.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return None, f"input {pname!r} ({v.name}) has no tensor metadata"
            args.append(val)
        else:
            args.append(v)
    try:
        modes = {id(a.fake_mode): a.fake_mode for a in args if hasattr(a, "fake_mode")}
        if len(modes) > 1:  # e.g. make_fx gives parameters and inputs fakes of different modes
            args = _refake(args)
            modes = {id(a.fake_mode): a.fake_mode for a in args if hasattr(a, "fake_mode")}
        fake_mode = next(iter(modes.values()), None)
        with torch.no_grad():  # metadata only: no autograd graph (and no warning of the op's missing backward)
            if fake_mode is not None:
                with fake_mode:
                    out = rule.overload(*args)
            else:
                with torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
                    out = rule.overload(*args)
    except Exception as exc:  # the op's own checks: dtype, shape, device
        return None, f"{rule.overload} refuses these inputs: {exc}"
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if len(outs) != len(match.outputs):
        return None, f"{rule.overload} returns {len(outs)} outputs, the pattern {len(match.outputs)}"
    for i, (o, g) in enumerate(zip(outs, match.outputs)):
        want = g.meta.get("val")
        if not isinstance(want, torch.Tensor):
            continue
        same_shape = len(o.shape) == len(want.shape) and all(
            torch.fx.experimental.symbolic_shapes.statically_known_true(a == b) for a, b in zip(o.shape, want.shape)
        )
        if o.dtype != want.dtype or not same_shape:
            return None, (
                f"{rule.overload} output {i} would be {o.dtype} {tuple(o.shape)} where the graph has "
                f"{want.dtype} {tuple(want.shape)} ({g.name})"
            )
    return outs, None


def _check(rule: Rule, match: Match, facts: _Facts) -> Tuple[Optional[Tuple[Any, ...]], Optional[str]]:
    """The safety checks of one structural match: (fake outputs, None) when it may be replaced."""
    reason = _escaping(match) or _hazards(match, facts)
    if reason is None:
        via = creates_cycle(match.node_set, facts.pos)
        if via is not None:
            reason = f"replacing it would form a cycle through {via.name!r} (the match is not convex)"
    reason = reason or _placement(match, facts.pos)
    if reason is None and rule.filter is not None and not rule.filter(match):
        reason = "the rule's filter declined it"
    if reason is not None:
        return None, reason
    fake, reason = _fake_run(rule, match, facts)
    if fake is not None:
        reason = _layout_users(fake, match, facts)
    return (None, reason) if reason else (fake, None)


def _sizes_differ(rule: Rule, cp: Any, match: Match, matcher: Matcher) -> Optional[str]:
    """Why a pattern computing numbers from its inputs' sizes (``x.shape[-1]``) does not hold at this
    match's sizes, or None. Those numbers matched any number; traced again at the bound inputs' own
    sizes, the pattern must match here with the same bindings (a model dividing by a constant 8 took
    the pattern's ``x.shape[-1]``, and the op divided rows of 16 by 16; found by a probe). Symbolic
    sizes are traced at their example values, then with each symbol doubled in turn: a number that
    depends on one is a symbol in the graph, and one that does not is the same in every trace."""
    if not cp.sized:
        return None
    missing, dims, dtypes = _bound_tensors(cp, match)
    if missing is not None:
        return f"input {missing!r} has no tensor metadata, and the pattern computes {', '.join(cp.sized)} from its sizes"
    scalars = tuple((name, match.bindings[name]) for name in rule.scalar_params if name in match.bindings)
    values = _symbol_values(dims)
    if values is None:
        return (f"the pattern computes {', '.join(cp.sized)} from its inputs' sizes, and {dims} have sizes with no "
                f"example value here: pass such numbers as scalar parameters (`n: int`)")
    for doubled in [None] + sorted(values, key=str):
        sizes = _sizes_at(dims, {sym: 2 * v if sym == doubled else v for sym, v in values.items()})
        try:
            at = rule.compiled_at(cp.ir, tuple(zip(sizes, dtypes)), scalars)
        except Exception as exc:  # noqa: BLE001 - the pattern's own trace at these sizes
            return f"the pattern could not be traced at this match's sizes {sizes}: {exc}"
        if not any(m is not None and m.node_set == match.node_set and _same_bindings(m, match)
                   for m, _ in matcher.matches_at(at, match.anchor)):
            which = "these sizes" if doubled is None else f"other values of its symbolic size {doubled}"
            return (f"the pattern computes {', '.join(cp.sized)} from its inputs' sizes, and at {which} "
                    f"{sizes} the graph's numbers are not those it computes")
    return None


def _scalars_differ(rule: Rule, cp: Any, match: Match) -> Optional[str]:
    """Why the pattern does not hold at this match's scalar values, or None: traced with them (at the
    match's sizes) it runs other ops than with its example values (Python control flow on a scalar
    parameter), so the op, which runs the pattern at those values, would not compute what the graph
    does. Traced in the export IR where the rule has it: Python's branches are the same in every IR,
    and it traces fastest."""
    if not rule.scalar_params:
        return None
    values = tuple((name, match.bindings[name]) for name in rule.scalar_params if name in match.bindings)
    inputs = _bound_sizes(cp, match)
    ir = "export" if rule.irs is None or "export" in rule.irs else cp.ir
    if not values or inputs is None or not rule.ops_differ_at(ir, inputs, values):
        return None
    shown = ", ".join(f"{name}={value!r}" for name, value in values)
    return (f"traced with {shown}, the pattern runs other ops than those matched here (Python control flow on a "
            f"scalar parameter), and the op would run those: write the branch as tensor ops (torch.where), or "
            f"one rule per case")


def _bound_sizes(cp: Any, match: Match) -> Optional[Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]]:
    """The (shape, dtype) of each tensor the match binds, symbols at their example values (None where
    one has no metadata or example value)."""
    missing, dims, dtypes = _bound_tensors(cp, match)
    values = None if missing is not None else _symbol_values(dims)
    if values is None:
        return None
    return tuple(zip(_sizes_at(dims, values), dtypes))


def _bound_tensors(cp: Any, match: Match) -> Tuple[Optional[str], List[Tuple[Any, ...]], List[torch.dtype]]:
    """The shape and dtype of each tensor the match binds to the pattern's tensor parameters, and the
    first parameter bound to no tensor metadata (None when all are)."""
    dims, dtypes = [], []
    for name in cp.tensor_params:
        bound = match.bindings.get(name)
        val = bound.meta.get("val") if isinstance(bound, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return name, dims, dtypes
        dims.append(tuple(val.shape))
        dtypes.append(val.dtype)
    return None, dims, dtypes


def _sizes_at(dims: List[Tuple[Any, ...]], values: Dict[Any, int]) -> List[Tuple[int, ...]]:
    """``dims`` with each symbolic size at ``values``."""
    return [tuple(d if type(d) is int else int(d.node.expr.xreplace(values)) for d in shape) for shape in dims]


def _symbol_values(dims: List[Tuple[Any, ...]]) -> Optional[Dict[Any, int]]:
    """The example value of each symbol in these sizes, or None where one has none (unbacked)."""
    values: Dict[Any, int] = {}
    for shape in dims:
        for d in shape:
            if type(d) is int:
                continue
            env = d.node.shape_env  # torch 2.11 renamed var_to_val, and warns on the old name
            known = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else getattr(env, "var_to_val", {})
            for sym in d.node.expr.free_symbols:
                if sym not in known:
                    return None
                values[sym] = int(known[sym])
    return values


def _same_bindings(a: Match, b: Match) -> bool:
    """The same inputs bound to the same parameters (a model's A / 4 + B / 16 matched a / 16 + b / 4
    with the operands of its add swapped; found by a review), and the same scalars captured (a NaN
    is the same NaN)."""
    def same(x: Any, y: Any) -> bool:
        return x is y if isinstance(y, fx.Node) else (x == y or (x != x and y != y))

    return a.bindings.keys() == b.bindings.keys() and all(same(a.bindings[k], b.bindings[k]) for k in b.bindings)


def _laid_out_otherwise(o: torch.Tensor, want: torch.Tensor, size_one_too: bool = False) -> bool:
    """Whether two tensors of one shape differ in strides where it matters: a dim of size 1 aside,
    unless ``size_one_too`` (torch.cond compares its branches' strides whole)."""
    a, b = o.stride(), want.stride()
    if all(type(x) is int for x in a) and all(type(x) is int for x in b) and a == b:  # most matches: no symbols
        return False
    known = torch.fx.experimental.symbolic_shapes.statically_known_true
    return not all((not size_one_too and known(d <= 1)) or known(x == y) for d, x, y in zip(want.shape, a, b))


# Ops that read their input's storage as laid out: given another layout they read other elements
_STORAGE_READS = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_copy.default}
# Views that fail on some layouts (a transpose or a slice takes any): view needs strides it can
# merge, view(dtype) and view_as_complex a last stride of 1
_FRAGILE_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.view.dtype,
                  torch.ops.aten.view_as_complex.default}
# Ops whose result is laid out afresh, whatever their inputs' layout: past them a layout is the graph's
_FRESH_LAYOUT = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                 torch.ops.aten.matmul.default, torch.ops.aten.linear.default, torch.ops.aten.baddbmm.default}


def _strides(v: Any) -> Any:
    return tuple(_strides(t) for t in v) if isinstance(v, (list, tuple)) else (
        tuple(v.stride()) if isinstance(v, torch.Tensor) else None)


def _layout_changed(new: Any, old: Any, whole: bool = False) -> bool:
    if isinstance(new, (list, tuple)) and isinstance(old, (list, tuple)):
        return len(new) == len(old) and any(_layout_changed(a, b, whole) for a, b in zip(new, old))
    return isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and _laid_out_otherwise(new, old, whole)


def _subgraph_nodes(node: fx.Node):
    """The nodes of the subgraphs a higher-order op runs (a torch.cond branch, a no_grad block)."""
    root = node.graph.owning_module
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "get_attr" and root is not None:
            sub = getattr(root, a.target, None)
            if isinstance(sub, fx.GraphModule):
                for n in sub.graph.nodes:
                    yield n
                    if isinstance(n.target, torch._ops.HigherOrderOperator):
                        yield from _subgraph_nodes(n)


def _layout_dependent(n: fx.Node) -> bool:
    """Whether ``n`` may fail, or read other elements, given its input in another layout."""
    return n.target in _FRAGILE_VIEWS or n.target in _STORAGE_READS


def _layout_users(fake: Tuple[Any, ...], match: Match, facts: "_Facts") -> Optional[str]:
    """Why an output laid out otherwise than the graph's would break what uses it, or None. The op's
    outputs take its fake impl's strides (a kernel writing rows contiguous where eager kept a
    transposed input's layout), and the graph's later nodes were traced on the old ones: a view
    taken of them, directly or after ops that keep their input's layout (a transpose, a mul, a
    split), may not be a view of the op's (a crash when the program runs), and as_strided would read
    other elements (a wrong result). The fake values are propagated as far as a layout differs; a
    higher-order op is refused if its subgraphs, or what follows it, hold a view."""
    held = facts.where.held
    whole = held is not None and held.whole
    changed: Dict[fx.Node, Any] = {}
    for o, g in zip(fake, match.outputs):
        want = g.meta.get("val")
        why = _held_output(g, o, facts, True)
        if why is not None:
            return why
        if _layout_changed(o, want, whole):
            changed[g] = _with_layout(want, o, whole)
    if not changed:
        return None
    pos, seen = facts.pos, []
    todo = [(pos[u], id(u), u) for g in changed for u in g.users if u not in match.node_set]
    heapq.heapify(todo)
    while todo:
        u = heapq.heappop(todo)[2]
        if u.op == "output":
            if held is not None and not held.direct:
                why = next(filter(None, (_held_output(a, changed[a], facts) for a in u.all_input_nodes if a in changed)), None)
                if why is not None:
                    return why
            continue
        if u in changed:
            continue
        sources = [a for a in u.all_input_nodes if a in changed]
        key = (u, repr([(a.name, _strides(changed[a])) for a in sources]))  # symbolic strides print, not hash
        if key in facts.layouts_done:  # every later node checked already, from another match's outputs
            continue
        seen.append(key)
        if key not in facts.layouts:
            facts.layouts[key] = _layout_step(u, changed, sources[0], whole)
        value, why = facts.layouts[key]
        if why is not None:
            return why
        if value is not None:
            changed[u] = value
            for w in u.users:
                heapq.heappush(todo, (pos[w], id(w), w))
    facts.layouts_done.update(seen)  # a whole walk without a refusal
    return None


def _layout_step(u: fx.Node, changed: Dict[fx.Node, Any], source: fx.Node, whole: bool) -> Tuple[Any, Optional[str]]:
    """``u`` run on the changed layouts: (its value where its own layout changes too, else None;
    why it cannot take them, else None)."""
    def refused(what: str) -> Tuple[Any, str]:
        o = changed[source]
        return None, (f"the op's result would have strides {_strides(o)} where the graph has "
                      f"{_strides(source.meta.get('val'))} ({source.name}), and {u.name} ({u.target}), which uses it, {what}")

    if u.target in _STORAGE_READS:
        return refused("reads its input's storage as laid out")
    if isinstance(u.target, torch._ops.HigherOrderOperator):
        inner = next((n for n in _subgraph_nodes(u) if _layout_dependent(n)), None)
        if inner is not None:
            return refused(f"runs {inner.name} ({inner.target}) in its subgraph, which depends on the layout")
        later = _later_layout_dependent(u)
        if later is not None:
            return refused(f"feeds {later.name} ({later.target}), which depends on the layout of what it gets")
        return None, None
    if not isinstance(u.target, torch._ops.OpOverload) and u.target is not operator.getitem:
        return refused("is not an op whose result fxkern can check for another layout")
    args, kwargs = fx.node.map_arg((u.args, u.kwargs), lambda n: changed.get(n, n.meta.get("val")))
    first = changed[source]
    mode = getattr(first[0] if isinstance(first, (list, tuple)) else first, "fake_mode", None)
    try:
        with quiet_fake_errors(), mode or contextlib.nullcontext():
            value = u.target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the op's own check, as at run time
        return refused(f"refuses it: {str(exc).splitlines()[0]}")
    return (value if _layout_changed(value, u.meta.get("val"), whole) else None), None


def _later_layout_dependent(node: fx.Node) -> Optional[fx.Node]:
    """A view that may fail, or a storage read, among the nodes computed from ``node`` before a
    matmul lays its result out afresh, or in the subgraphs of higher-order ops among them, or None
    (a review found every later transpose refusing)."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _layout_dependent(n):
            return n
        if isinstance(n.target, torch._ops.HigherOrderOperator):
            inner = next((m for m in _subgraph_nodes(n) if _layout_dependent(m)), None)
            if inner is not None:
                return inner
        if n.target not in _FRESH_LAYOUT:
            todo.extend(n.users)
    return None


def _held_output(node: fx.Node, value: Any, facts: "_Facts", the_ops: bool = False) -> Optional[str]:
    """Why ``node``, now laid out as ``value``, may not leave the graph so, or None (a transposed
    result in a torch.cond branch, replaced by a contiguous one, broke run_decompositions() and
    re-export; found by a review). ``the_ops``: ``node`` is the op's own result, not a later value."""
    held, want = facts.where.held, node.meta.get("val")
    for i in facts.held_at.get(node, ()):
        if isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor) and _laid_out_otherwise(value, want, held.whole):
            via = "" if the_ops else ", computed from the op's result"
            return (f"{held.what} {i} would have strides {tuple(value.stride())} where the graph has "
                    f"{tuple(want.stride())} ({node.name}{via}), and {held.why}")
    return None


def _ordered_rules(rules: Union[RuleSet, Sequence[Rule], Rule, None]) -> List[Rule]:
    given = rules
    if isinstance(rules, Rule):  # what fxkern.replace returns: a set of one
        rules = [rules]
    elif rules is not None and not isinstance(rules, RuleSet):
        rules = list(rules) if hasattr(rules, "__iter__") and not isinstance(rules, (str, bytes)) else [rules]
    if rules is not None and not isinstance(rules, RuleSet) and not all(isinstance(r, Rule) for r in rules):
        raise TypeError(f"rules= takes a fxkern.RuleSet, a list of rules or one rule (what fxkern.replace returns), "
                        f"got {given!r}; fxkern.library.rules() is the library's set")
    rs = list(rules if rules is not None else default_rules())
    return sorted(rs, key=lambda r: (r.priority if r.priority is not None else 0, r.order))


@dataclass
class _Analysis:
    """One graph's accepted matches, and those of the subgraphs its higher-order ops run."""

    accepted: List[_Candidate]
    pos: Dict[fx.Node, float]
    inner: Dict[str, "_Analysis"] = field(default_factory=dict)  # by the subgraph's attribute name

    def replaced(self) -> List[_Candidate]:
        return self.accepted + [c for a in self.inner.values() for c in a.replaced()]

    def only(self, name: str) -> "_Analysis":
        """The same analysis with the matches of the rule ``name`` alone (every instance of a region:
        one rule each) for verification's search for the culprit."""
        return _Analysis([c for c in self.accepted if c.rule.name == name], self.pos,
                         {attr: a.only(name) for attr, a in self.inner.items()})


def analyse(gm: fx.GraphModule, rules: Union[RuleSet, Sequence[Rule], None], irs: Sequence[str]):
    """Every rule's safe candidates, the accepted (non-overlapping) ones, and the report (the
    accepted matches of this graph only; :func:`_analyse` also has its subgraphs')."""
    tree, report = _analyse(gm, rules, irs)
    return tree.accepted, report, tree.pos


def _rule_candidates(rule: Rule, irs: Sequence[str], matcher: Matcher, facts: _Facts, sized: bool,
                     taken: Optional["_Taken"] = None) -> Optional[Tuple[int, List[_Candidate], List[NearMiss], Optional[NearMiss]]]:
    """One rule's candidate sites, safe matches and near-misses in one graph. Without ``sized``,
    None as soon as a walk matches or stops at a literal: the pattern's numbers computed from its
    inputs' sizes must then be known (``Rule.compiled(..., sized=True)``) before any is accepted.
    A match that overlaps what earlier rules took (``taken``) is not checked: it is returned
    unchecked (no fake outputs), and loses the overlap when accepted (RMSNorm inside the residual
    add's RMSNorm, say: two fifths of a Llama's matches)."""
    pos = facts.pos
    # One variant per distinct traced graph, with every anchor dtype it was traced for:
    # identical graphs for float32 and bfloat16 are one variant that serves both.
    variants: Dict[Any, Tuple[set, Any]] = {}
    for ir in irs:
        if rule.irs is not None and ir not in rule.irs:
            continue
        if (rule, ir) not in facts.anchor_dtypes:  # the same on a rule's second look
            facts.anchor_dtypes[rule, ir] = _anchor_dtypes(rule, ir, facts)
        for dtype in facts.anchor_dtypes[rule, ir]:
            cp = rule.compiled(ir, dtype, sized)
            key = tuple((n.target, repr(n.args)) for n in cp.nodes)
            variants.setdefault(key, (set(), cp))[0].add(dtype)
    anchors = {}
    site_lists = {}  # each variant's anchor op's calls, in graph order: most variants share one list
    for dtypes, cp in variants.values():
        site_lists.setdefault(id(matcher.sites(cp)), matcher.sites(cp))
        for a in matcher.candidates(cp):
            anchors.setdefault(a, []).append((dtypes, cp))
    safe: List[_Candidate] = []
    misses: List[NearMiss] = []
    closest: Optional[Failure] = None
    for anchor in sorted(anchors, key=pos.__getitem__):
        best: Optional[Failure] = None
        refusal: Optional[Tuple[Match, str]] = None
        accepted_here = overlapping = None
        val = anchor.meta.get("val")
        if rule.dtypes is not None and not (isinstance(val, torch.Tensor) and val.dtype in rule.dtypes):
            continue
        for dtypes, cp in anchors[anchor]:
            if None not in dtypes and isinstance(val, torch.Tensor) and val.dtype not in dtypes:
                continue
            for m, fail in matcher.matches_at(cp, anchor):
                if not sized and (m is not None or fail.literal):
                    return None
                if m is None:
                    if best is None or fail.depth > best.depth:
                        best = fail
                    continue
                if taken is not None and taken.clash(m) is not None:
                    overlapping = _Candidate(rule, m, None)
                    break
                reason = _sizes_differ(rule, cp, m, matcher) or _scalars_differ(rule, cp, m)
                if reason is not None:
                    refusal = refusal or (m, reason)
                    continue
                fake, reason = _check(rule, m, facts)
                if reason is None:
                    accepted_here = _Candidate(rule, m, fake)
                    break
                refusal = refusal or (m, reason)
            if accepted_here is not None or overlapping is not None:
                break
        if accepted_here is not None or overlapping is not None:
            safe.append(accepted_here or overlapping)
        elif refusal is not None:
            misses.append(NearMiss(rule.name, [n.name for n in refusal[0].nodes], refusal[1]))
        elif best is not None and best.depth >= max(2, len(next(iter(variants.values()))[1].nodes) // 2):
            misses.append(NearMiss(rule.name, [n.name for n in best.nodes], best.reason))
        elif best is not None and (closest is None or best.depth > closest.depth):
            closest = best
    lists = [found for found in site_lists.values() if found]
    n_sites = sum(map(len, lists))  # the index's lists, one an op: no node is in two (a set of them was 1% of the pass)
    if closest is None and not safe and not misses and lists:  # no walk: the cheap test ruled every site out
        first = min((found[0] for found in lists), key=pos.__getitem__)
        for _, cp in variants.values():
            for m, fail in matcher.matches_at(cp, first):
                if m is None and (closest is None or fail.depth > closest.depth):
                    closest = fail
    if safe and misses:  # a rule's other dtype's trace inside its own match (OLMo's rotation without its cast back)
        covered = {n.name for c in safe for n in c.match.nodes}
        misses = [m for m in misses if not covered.issuperset(m.nodes)]
    near = None if closest is None else NearMiss(rule.name, [n.name for n in closest.nodes], closest.reason)
    return n_sites, safe, misses, near


def _analyse(gm: fx.GraphModule, rules: Union[RuleSet, Sequence[Rule], None], irs: Sequence[str],
             where: _Where = _Where(), subgraphs: bool = True,
             kept: Sequence[_Candidate] = (), fixed: FrozenSet[str] = frozenset()) -> Tuple[_Analysis, Report]:
    """Every rule's candidates in ``gm``, the accepted ones, and the report. ``kept``: matches
    accepted before any rule's (after the regions'): a first pass's, when views moved in between.
    ``fixed``: names of nodes no match may replace (a preserved module call's inputs and outputs)."""
    graph = gm.graph
    by_target, twins = index_graph(graph)
    matcher = Matcher(graph, (by_target, twins))
    facts = _Facts(graph, by_target, where)
    pos = facts.pos
    report = Report()
    ordered = _ordered_rules(rules)
    _trace_together(ordered, irs, facts)
    # Matches are accepted rule by rule in rank order (regions first, then rules by priority), each
    # rule's the larger first, then in graph order; a later one that overlaps loses.
    taken = _Taken()
    for rule in ordered:  # the report lists the rules first, then the regions
        report.rules.setdefault(rule.name, RuleReport())
    regions: List[_Candidate] = []
    if where.top:
        _regions(graph, facts, report, regions)
    if fixed:  # a region too: apply raised on a preserved call's output that a region replaced
        regions = _outside(regions, fixed, report)
    rank = {r: i for i, r in enumerate(_region_rules(regions))}
    taken.accept(sorted(regions, key=lambda c: (rank[c.rule], -len(c.match.nodes), pos[c.match.anchor])), report)
    taken.accept(kept, report)
    again = {(c.rule, frozenset(c.match.nodes)) for c in kept}
    for rule in ordered:
        rr = report.rules.setdefault(rule.name, RuleReport())
        found = _rule_candidates(rule, irs, matcher, facts, sized=False)
        if found is None:  # it matches, or nearly: find the numbers it computes from sizes first
            found = _rule_candidates(rule, irs, matcher, facts, sized=True, taken=taken)
        rr.candidates, candidates, misses, rr.closest = found
        rr.near_misses.extend(misses)
        candidates = [c for c in candidates if (rule, frozenset(c.match.nodes)) not in again]
        if fixed:
            candidates = _outside(candidates, fixed, report)
        taken.accept(sorted(candidates, key=lambda c: (-len(c.match.nodes), pos[c.match.anchor])), report)
    accepted = taken.accepted
    accepted.sort(key=lambda c: pos[c.match.anchor])
    locations: Dict[str, str] = {}
    for c in accepted:
        info = MatchInfo(c.rule.name, [n.name for n in c.match.nodes], _location(c.match.anchor, locations))
        report.rules[c.rule.name].matches.append(info)
    inner = _nested(gm, rules, irs, report, facts) if subgraphs else {}
    for rr in report.rules.values():
        report.matches.extend(rr.matches)
        report.near_misses.extend(rr.near_misses)
    return _Analysis(accepted, pos, inner), report


def _outside(candidates: List[_Candidate], fixed: FrozenSet[str], report: Report) -> List[_Candidate]:
    """The candidates that replace no node named in ``fixed``; the others are near-misses of their
    rule (or region) in ``report``."""
    kept = []
    for c in candidates:
        named = next((n.name for n in c.match.nodes if n.name in fixed), None)
        if named is None:
            kept.append(c)
            continue
        why = (f"'{named}' is a value a preserved module call takes or returns "
               f"(preserve_module_call_signature): the match would replace it")
        report.rules[c.rule.name].near_misses.append(NearMiss(c.rule.name, [n.name for n in c.match.nodes], why))
    return kept


class _Taken:
    """The graph nodes that accepted matches replace, by the rule that took each."""

    def __init__(self):
        self.by_node: Dict[fx.Node, Rule] = {}
        self.outputs: Set[fx.Node] = set()
        self.accepted: List[_Candidate] = []

    def clash(self, m: Match) -> Optional[Rule]:
        """The rule that took one of ``m``'s nodes, or an input of it that its match removes (an
        accepted match's outputs survive, remapped); None when there is none."""
        taken = self.by_node
        if not taken.keys().isdisjoint(m.nodes):
            return next(taken[n] for n in m.nodes if n in taken)
        return next((taken[v] for v in m.bindings.values() if isinstance(v, fx.Node) and v in taken
                     and v not in self.outputs), None)

    def accept(self, candidates: Iterable[_Candidate], report: Report) -> None:
        for c in candidates:
            clash = self.clash(c.match)
            if clash is not None:
                report.rules[c.rule.name].near_misses.append(
                    NearMiss(c.rule.name, [n.name for n in c.match.nodes], f"overlap lost to rule {clash.name!r}"))
                continue
            for n in c.match.nodes:
                self.by_node[n] = c.rule
            self.outputs.update(c.match.outputs)
            self.accepted.append(c)


# The higher-order ops whose subgraphs are rewritten: each runs its subgraph as a plain function,
# under a grad mode, an autocast state (checked per match), or a branch condition.
_BLOCKS = {
    "wrap_with_set_grad_enabled": "a torch.no_grad() block",
    "wrap_with_autocast": "a torch.autocast block",
    "cond": "a torch.cond branch",
}


def _held_block_outputs(node: fx.Node, hop: str, sub: fx.GraphModule, parent: _Where) -> HeldOutputs:
    """The outputs of the subgraph that ``node`` runs which must keep their strides: all of a torch.cond
    branch's, and those of a block that a view or ``as_strided`` takes after it (the graph around a
    block was traced on the old ones). Inside a graph that holds outputs itself, all of them."""
    if hop == "cond":
        return HeldOutputs(frozenset(), "the torch.cond branch's output", "both branches must return the same strides",
                           whole=True)
    n = len(torch.utils._pytree.tree_leaves(sub.graph.find_nodes(op="output")[0].args[0]))
    free = set(range(n)) if parent.held is None else set()
    for u in node.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int):
            free.clear()
        elif _later_layout_dependent(u) is not None:
            free.discard(u.args[1])
    return HeldOutputs(frozenset(free), "the block's output",
                       "a view after the block takes the old strides (the graph around it was traced on them)")


def _nested(gm: fx.GraphModule, rules: Any, irs: Sequence[str], report: Report, facts: _Facts) -> Dict[str, _Analysis]:
    """The subgraphs of higher-order ops: ``torch.no_grad()`` and ``torch.autocast`` blocks export
    as ``wrap_with_set_grad_enabled``/``wrap_with_autocast`` of a submodule, ``torch.cond`` as
    two. Their matches join the report, named ``submodule.node``; other higher-order ops'
    subgraphs (a flex_attention score_mod, say), and subgraphs kept under a submodule's name,
    are analysed and reported, never rewritten. Regions are found in the program's own graph
    only: a block's nodes inside a subgraph are part of a run that goes on outside it."""
    inner: Dict[str, _Analysis] = {}
    done: Dict[int, _Analysis] = {}  # by module: one subgraph under two names is analysed once
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        hop = node.target.__name__
        for arg in node.args:
            if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
                continue
            try:
                sub = operator.attrgetter(arg.target)(gm)
            except AttributeError:
                continue
            if not isinstance(sub, fx.GraphModule):
                continue
            rewritable = hop in _BLOCKS and "." not in arg.target
            if id(sub) in done:
                if rewritable:
                    inner[arg.target] = done[id(sub)]
                continue
            autocast = (_autocast_state(node, facts.autocast_at(node)) if hop == "wrap_with_autocast"
                        else facts.autocast_at(node))
            where = _Where(autocast, held=_held_block_outputs(node, hop, sub, facts.where), top=False)
            tree, sub_report = _analyse(sub, rules, irs, where)
            done[id(sub)] = tree
            if rewritable:
                inner[arg.target] = tree
                _merge(report, sub_report, arg.target, _BLOCKS[hop])
                continue
            why = ("a subgraph kept under a submodule's name" if hop in _BLOCKS else
                   "a higher-order op whose subgraphs fxkern does not rewrite")
            for m in sub_report.matches:
                report.rules.setdefault(m.rule, RuleReport()).near_misses.append(NearMiss(m.rule, [f"{arg.target}.{n}" for n in m.nodes], (
                    f"inside {hop} ({arg.target}), {why}; ep.run_decompositions() may inline it, and the rule then applies")))
    return inner


def _merge(report: Report, sub: Report, attr: str, block: str) -> None:
    for name, srr in sub.rules.items():
        rr = report.rules.setdefault(name, RuleReport())
        rr.candidates += srr.candidates
        rr.matches.extend(MatchInfo(m.rule, [f"{attr}.{n}" for n in m.nodes],
                                    f"{m.location}{' ' if ', in ' in m.location else ', '}in {block}")
                          for m in srr.matches)
        rr.near_misses.extend(NearMiss(m.rule, [f"{attr}.{n}" for n in m.nodes], m.reason) for m in srr.near_misses)
        if rr.closest is None and srr.closest is not None:
            rr.closest = NearMiss(name, [f"{attr}.{n}" for n in srr.closest.nodes], srr.closest.reason)


def _regions(graph: fx.Graph, facts: _Facts, report: Report, safe: List[_Candidate]) -> None:
    """Region instances become candidates ahead of every rule (a region is an instruction)."""
    from fxkern.region import (columns_known, find, interface, repeated_run,  # the module, not the context manager
                               in_call_order, shares_its_line, unfinished, unordered_inputs)

    present: Dict[str, set] = {}  # what unfinished() reads of the whole graph, computed once
    for site, nodes, exact in find(graph):
        inputs, outputs = interface(nodes)
        rr = report.rules.setdefault(site.label, RuleReport())
        rr.candidates += 1
        partial = None if exact else unfinished(site, nodes, graph, present)
        if partial is not None:
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], partial))
            continue
        if not exact and shares_its_line(site):
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], (
                "this `with fxkern.region(...)` line ran with several targets, and this graph's stack traces "
                "cannot tell their blocks apart: export with torch.export's default (non-strict) tracing, which "
                "tags each run, or give each target its own line")))
            continue
        again = None if exact else repeated_run(nodes, site)
        if again is not None:
            one_line = ("; these stack traces do not say where on a line a call is (they do from Python 3.11 with "
                        "torch 2.13), so a line that calls one op twice (h * torch.sigmoid(1.702 * h)) reads the same "
                        "way: write it as two statements" if not columns_known(again, site) else "")
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], (
                f"the block seems to have run more than once here ({again.name!r} repeats a call written once in the "
                f"block): put the loop outside the region, or the block in a module or function of its own, or export "
                f"with torch.export's default (non-strict) tracing, which tells runs apart{one_line}")))
            continue
        writer = next((n for n in nodes if mutates(n)), None)
        if writer is not None:
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes],
                                           f"the region updates a tensor in place ({writer.name!r}); an op call would drop that"))
            continue
        overload = site.op.default if hasattr(site.op, "default") else site.op
        inputs, known = in_call_order(site, nodes, inputs)
        unordered = None if known else unordered_inputs(nodes, inputs)
        if unordered is not None:
            read, call = unordered
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], (
                f"the block's inputs {[i.name for i in read]} are first read by one call that this graph holds as "
                f"{len(call)} ops ({', '.join(n.name for n in call[:6])}{', ...' if len(call) > 6 else ''}), so the "
                f"order that maps them to {overload}'s arguments cannot be read here (it is the order written, which "
                f"torch.export's graph keeps): apply the region to the exported program before run_decompositions()")))
            continue
        n_args = len(overload._schema.arguments)
        if not outputs:
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], (
                "nothing the block computes is used after it (its results are unused here), so there is no "
                "value for the op to return; use the block's result, or drop the block")))
            continue
        if n_args != len(inputs):
            scalars = [a.name for a in overload._schema.arguments if not str(a.type).startswith("Tensor")]
            why = (f": a region passes the op tensors only, the values the block reads from outside it, and "
                   f"{overload} takes non-tensor arguments {scalars} too; register an op of tensors only, or write "
                   f"a rule (fxkern.replace), whose pattern captures scalars" if scalars else "")
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], (
                f"the region has inputs {[i.name for i in inputs]} and outputs {[o.name for o in outputs]}, "
                f"but {overload} takes {n_args} arguments{why}")))
            continue
        n_returns = len(overload._schema.returns)
        if len(outputs) > n_returns:
            rr.near_misses.append(NearMiss(site.label, [n.name for n in nodes], _more_outputs(outputs, nodes, overload)))
            continue
        names = tuple(f"in{i}" for i in range(len(inputs)))
        rule = Rule(site.label, None, site.op, arg_params=names, priority=-(10**9))
        anchor = max(nodes, key=facts.pos.__getitem__)
        match = Match(anchor, [n for n in nodes if not is_inert(n)], set(), outputs, dict(zip(names, inputs)))
        fake, reason = _check(rule, match, facts)
        if reason is not None:
            rr.near_misses.append(NearMiss(site.label, [n.name for n in match.nodes], reason))
            continue
        safe.append(_Candidate(rule, match, fake))


def _more_outputs(outputs: List[fx.Node], nodes: List[fx.Node], overload: Any) -> str:
    """Why a block whose values leave it more than its op returns is not replaced, with what uses them."""
    inside = set(nodes)
    uses = {o.name: sorted(u.name for u in o.users if u not in inside) for o in outputs}
    saved = any(u.op == "output" for o in outputs for u in o.users) and len(outputs) > 1
    why = (" (one is an output of the graph itself: a buffer the block updates in place, which the op would have "
           "to return too, or, in a training graph, a value autograd saves for the backward, which "
           "torch.no_grad() or torch.inference_mode() leaves out)"
           if saved else ": have the op return them too, or keep what else uses them out of the block")
    return (f"the block's values {sorted(uses)} are used after it ({', '.join(f'{k} by {v}' for k, v in sorted(uses.items()))}), "
            f"but {overload} returns {len(overload._schema.returns)}{why}")


def _region_rules(safe: List[_Candidate]) -> List[Rule]:
    out = []
    for c in safe:
        if c.rule.pattern is None and c.rule not in out:
            out.append(c.rule)
    return out


def _trace_together(rules: List[Rule], irs: Sequence[str], facts: _Facts) -> None:
    """The rules' traces in these IRs, made together where that is cheaper (``trace_together``):
    at float32 first, which names each rule's anchor op, then at the dtypes of the graph's anchors."""
    for ir in irs:
        trace_together(rules, ir, torch.float32)
        wanted: Dict[torch.dtype, List[Rule]] = {}
        for rule in rules:
            if rule.irs is None or ir in rule.irs:
                facts.anchor_dtypes[rule, ir] = found = _anchor_dtypes(rule, ir, facts)
                for d in found:
                    wanted.setdefault(d, []).append(rule)
        for d, some in wanted.items():
            if d is not None and d != torch.float32:
                trace_together(some, ir, d)


def _anchor_dtypes(rule: Rule, ir: str, facts: _Facts) -> List[Optional[torch.dtype]]:
    """dtypes to trace the pattern for: those of the graph's candidate anchors (float32 when unknown)."""
    if rule.traced_once:
        return [None]
    found = list(facts.dtypes_at(rule.compiled(ir, torch.float32).anchor.target)) or [torch.float32]
    return found if rule.dtypes is None else [d for d in found if d in rule.dtypes]


# A pattern that computes in float32 between casts (transformers' softmax(..., dtype=torch.float32).to(
# dtype)) ends in the float32 op in its float32 trace, where the casts are gone, and in the downcast in
# a 16-bit one: a 16-bit model's float32 softmax asked for float32 only, and its 16-bit form was never
# traced in core ATen (found by a probe). The dtypes cast to float32 shortly before such an op count too.
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default,
          torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}


def _downcast_to(node: fx.Node) -> List[torch.dtype]:
    """The floating dtypes other than float32 that casts reading ``node`` give: a pattern whose 16-bit
    inputs promote to float32 inside it without a cast (OLMo's 16-bit queries times float32 tables)
    and ends in a cast back has that cast in its 16-bit trace only, and in core ATen a float32
    trace with none (the export IR keeps the no-op ``to``)."""
    found = []
    for u in node.users:
        val = u.meta.get("val")
        if u.target in _CASTS and isinstance(val, torch.Tensor) and val.dtype.is_floating_point \
                and val.dtype != torch.float32 and val.dtype not in found:
            found.append(val.dtype)
    return found


def _upcast_from(node: fx.Node, depth: int = 4) -> List[torch.dtype]:
    """The floating dtypes other than float32 that a cast within ``depth`` nodes before ``node`` reads."""
    found, todo, seen = [], [(node, 0)], set()
    while todo:
        n, k = todo.pop()
        if n in seen or k > depth:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            val = a.meta.get("val")
            if n.target in _CASTS and isinstance(val, torch.Tensor) and val.dtype.is_floating_point \
                    and val.dtype != torch.float32 and val.dtype not in found:
                found.append(val.dtype)
            if a.op == "call_function":
                todo.append((a, k + 1))
    return found


# ---- rewriting ------------------------------------------------------------------


def _with_layout(old: Any, fake: Any, whole: bool = False) -> Any:
    """The old output's value with the op's strides: later passes and exports read a node's layout
    from it (the old one, copied, claimed a transposed layout for a contiguous result)."""
    if not (isinstance(old, torch.Tensor) and isinstance(fake, torch.Tensor) and _laid_out_otherwise(fake, old, whole)):
        return old
    with (getattr(old, "fake_mode", None) or contextlib.nullcontext()):
        return torch.empty_strided(old.shape, fake.stride(), dtype=old.dtype, device=old.device)


def _rewrite(graph: fx.Graph, accepted: List[_Candidate], pos: Dict[fx.Node, float]) -> Dict[str, str]:
    """Replace each accepted match by one op call; returns {old output node name: new node name}."""
    renamed: Dict[str, str] = {}
    replaced: Dict[fx.Node, fx.Node] = {}
    # the name fx would make of each op, made once: fx re-derives it (a regex) at every call. A private fx
    # method: where a torch lacks it, fx names the nodes itself (name None), as before
    to_str = getattr(graph, "_target_to_str", None)
    names = {t: to_str(t) for t in {c.rule.overload for c in accepted} | {operator.getitem}} if to_str else {}
    for c in accepted:
        m, rule = c.match, c.rule
        nodes = m.node_set
        via = creates_cycle(nodes, pos)  # the graph changed since the analysis
        if via is not None:
            log.info("fxkern: skipping %s at %s: a cycle through %s after earlier rewrites", rule.name, m.anchor.name, via.name)
            continue
        args = []
        for pname in rule.arg_params:
            v = m.bindings[pname]
            args.append(replaced.get(v, v) if isinstance(v, fx.Node) else v)
        outside_users = [u for o in m.outputs for u in o.users if u not in nodes]
        point = min([m.anchor] + outside_users, key=pos.__getitem__)
        inputs = [a for a in args if isinstance(a, fx.Node)]
        if any(pos[a] >= pos[point] for a in inputs):
            log.info("fxkern: skipping %s at %s: would need reordering the graph", rule.name, m.anchor.name)
            continue
        prev = point.prev
        with graph.inserting_before(point):
            call = graph.call_function(rule.overload, tuple(args), name=names.get(rule.overload))
        _copy_meta(call, m.anchor)
        # checked equal in shape and dtype to the op's; strides are the op's
        vals = [_with_layout(o.meta.get("val"), f) for o, f in zip(m.outputs, c.fake_outputs)]
        call.meta["val"] = vals[0] if len(vals) == 1 else tuple(vals)
        pos[call] = (pos[prev] + pos[point]) / 2 if prev.op != "root" else pos[point] - 0.5
        new_outputs = [call]
        if len(m.outputs) > 1:
            new_outputs = []
            after = call
            for i, fv in enumerate(vals):
                with graph.inserting_after(after):
                    item = graph.call_function(operator.getitem, (call, i), name=names.get(operator.getitem))
                _copy_meta(item, m.outputs[i])
                item.meta["val"] = fv
                pos[item] = (pos[after] + pos[point]) / 2
                new_outputs.append(item)
                after = item
        for old, new in zip(m.outputs, new_outputs):
            old.replace_all_uses_with(new, delete_user_cb=lambda u: u not in nodes)
            replaced[old] = new
            renamed[old.name] = new.name
        for n in sorted(nodes, key=pos.__getitem__, reverse=True):
            for u in list(n.users):
                if is_inert(u):
                    graph.erase_node(u)
            graph.erase_node(n)
            pos.pop(n, None)
    return renamed


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node", "seq_nr", "torch_fn"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


# ---- entry points ---------------------------------------------------------------


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic collector off while a pass runs. The pass allocates tens of thousands of
    small objects that all stay alive (nodes, matches, positions), so each collection it triggers
    rescans the whole graph and frees nothing: about a third of the time on a 50k-node graph."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()



@dataclass
class _Base:
    """The GraphModule analysed: the one given, or a copy with its views moved, and what each moved
    view that was an output is now called."""

    gm: fx.GraphModule
    moved: Dict[str, str] = field(default_factory=dict)

    def rewrite(self, tree: _Analysis, inplace: bool) -> Tuple[fx.GraphModule, Dict[str, str]]:
        """:func:`_rewrite_tree` of this graph; the renamed outputs counted from the graph given."""
        gm, renamed = _rewrite_tree(self.gm, tree, inplace)
        return gm, {**renamed, **{old: renamed.get(new, new) for old, new in self.moved.items()}}


def _rewritten(gm: fx.GraphModule, rules: Any, irs: Sequence[str], inplace: bool = False,
               fixed: FrozenSet[str] = frozenset()) -> Tuple[Optional[fx.GraphModule], Dict[str, str], _Analysis, _Base]:
    """Analyse ``gm`` (with its views moved where :func:`_analysed` moves them: in a copy unless
    ``inplace``); when something is replaced, rewrite a copy (or ``gm`` itself when ``inplace``).
    Returns (new GraphModule or None when nothing matched, renamed outputs, the analysis, the
    GraphModule analysed)."""
    with _collector_paused():
        base, tree, _ = _analysed(gm, rules, irs, inplace, fixed=fixed)
        replaced = tree.replaced()
        if not replaced:
            if inplace and base.moved:
                gm.recompile()  # views moved: its code says what its graph does
            return None, {}, tree, base
        log.info("fxkern: replacing %d subgraphs (%s)", len(replaced), ", ".join(sorted({c.rule.name for c in replaced})))
        return (*base.rewrite(tree, inplace or base.gm is not gm), tree, base)


def _analysed(gm: fx.GraphModule, rules: Any, irs: Sequence[str], inplace: bool, where: _Where = _Where(),
              subgraphs: bool = True, fixed: FrozenSet[str] = frozenset()) -> Tuple[_Base, _Analysis, Report]:
    """:func:`_analyse` of ``gm``; then, where views outside its matches move above the elementwise op
    they view (:mod:`fxkern.views`: an add that a reshape kept from its norm), the views moved (in a
    copy unless ``inplace``) and the graph analysed again, the first pass's matches kept. ``fixed``:
    names of nodes that stay (a preserved module call's inputs and outputs). Returns the
    GraphModule analysed last, the analysis and the report."""
    tree, report = _analyse(gm, rules, irs, where, subgraphs=subgraphs, fixed=fixed)
    ordered = set(_ordered_rules(rules))
    first = [c for c in tree.accepted if c.rule in ordered]  # regions are found again
    # a match's nodes, and what it reads (a view it binds would be erased under it)
    taken = {n for c in tree.accepted for n in (*c.match.nodes, *c.match.copies, *c.match.bindings.values())
             if isinstance(n, fx.Node)} | {n for n in gm.graph.nodes if n.name in fixed}
    if not ordered or not views.movable(gm.graph, taken):
        return _Base(gm), tree, report
    if not inplace:
        gm, val_map = _copied(gm)
        taken = {val_map[n] for n in taken}
        first = [_translated(c, val_map) for c in first]
    moved = views.move_views(gm.graph, taken)
    log.debug("fxkern: moved %d views above the ops they view; matching again", len(moved))
    tree, report = _analyse(gm, rules, irs, where, subgraphs=subgraphs, kept=first, fixed=fixed)
    return _Base(gm, moved), tree, report


def _translated(c: _Candidate, val_map: Dict[fx.Node, fx.Node]) -> _Candidate:
    """``c`` in a copy of its graph (``val_map``: old node to new)."""
    tr = lambda v: val_map[v] if isinstance(v, fx.Node) else v  # noqa: E731
    m = c.match
    return _Candidate(c.rule, Match(tr(m.anchor), [tr(n) for n in m.nodes], {tr(n) for n in m.keep},
                                    [tr(n) for n in m.outputs], {k: tr(v) for k, v in m.bindings.items()},
                                    [tr(n) for n in m.copies]), c.fake_outputs)


def _copied(gm: fx.GraphModule) -> Tuple[fx.GraphModule, Dict[fx.Node, fx.Node]]:
    """A copy of ``gm``'s graph in a new GraphModule sharing its submodules and parameters, and the
    map from old nodes to new."""
    graph, val_map = _graph_copy(gm.graph)
    return fx.GraphModule(gm, graph), val_map


def _graph_copy(old_graph: fx.Graph) -> Tuple[fx.Graph, Dict[fx.Node, fx.Node]]:
    graph = fx.Graph()
    # the code generator too: ep.module()'s flattens and rebuilds its inputs and outputs (a dict
    # returned came back a tuple from apply without it; found by a review)
    graph.set_codegen(old_graph._codegen)
    val_map: Dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(old_graph, val_map))
    for old, copied in val_map.items():  # the copy renames a placeholder that shadows a builtin ("input")
        if old.op == "placeholder" and copied.name != old.name:
            copied.name = old.name
    return graph, val_map


def _rewrite_tree(gm: fx.GraphModule, tree: _Analysis, inplace: bool, recompile: bool = True) -> Tuple[fx.GraphModule, Dict[str, str]]:
    """Rewrite ``gm`` and the subgraphs with matches (a copy of each unless ``inplace``: the
    original program's submodules stay as they were)."""
    # Subgraphs are always rewritten in copies: ep.module() shares its submodules with the program,
    # so an in-place rewrite of one changed the ExportedProgram too (found by a review)
    subs = {name: _rewrite_tree(getattr(gm, name), t, False)[0] for name, t in tree.inner.items() if t.replaced()}
    if inplace:
        renamed = _rewrite(gm.graph, tree.accepted, tree.pos)
        for name, sub in subs.items():
            setattr(gm, name, sub)
        if recompile:
            gm.recompile()
        return gm, renamed
    graph, val_map = _graph_copy(gm.graph)
    moved = [_translated(c, val_map) for c in tree.accepted]
    renamed = _rewrite(graph, moved, _positions(graph))
    new = fx.GraphModule(gm, graph)
    for name, sub in subs.items():  # the copy took the original's; swap in the rewritten ones
        setattr(new, name, sub)
    return new, renamed


def apply(program: Any, rules: Union[RuleSet, Sequence[Rule], None] = None, *, verify: Union[bool, int] = False,
          ir: Optional[Union[str, Sequence[str]]] = None, inplace: bool = False) -> Any:
    """Replace every safe match of ``rules`` (default: the default rule set) and every
    ``fxkern.region`` in an ExportedProgram or GraphModule; returns a rewritten copy of the same kind.

    ``verify=True`` runs old and new once, on random values of the program's example inputs'
    shapes and dtypes, and raises :class:`VerificationError` on the first output that differs, naming
    the rule whose matches alone change it and where they matched. ``verify=N`` (an int) draws N
    such samples: an op that is wrong only for some values can pass one sample and fail among
    several. On a CPU program the ops run their references, so it checks the rewrite's wiring and
    the references, not the kernels.
    ``inplace=True`` (GraphModules only: a compiler pass owns its graph) rewrites
    ``program`` itself and skips the copy.
    """
    irs = _irs(ir)
    samples = _samples(verify)
    if inplace and not isinstance(program, fx.GraphModule):
        raise TypeError("inplace=True takes an fx.GraphModule; an ExportedProgram is always copied")
    if isinstance(program, torch.export.ExportedProgram):
        gm, renamed, tree, base = _rewritten(program.graph_module, rules, irs, fixed=_module_call_names(program))
        if gm is None:
            return program
        new = program._update(gm, _rename_outputs(program.graph_signature, renamed))
        if samples:
            def alone(rule: str) -> Callable:
                g, r = base.rewrite(tree.only(rule), False)
                return program._update(g, _rename_outputs(program.graph_signature, r)).module()
            old_fn, new_fn = program.module(), new.module()
            names = [s.arg.name if hasattr(s.arg, "name") else str(s.arg) for s in program.graph_signature.output_specs
                     if str(s.kind).endswith("USER_OUTPUT")]
            for sample in range(samples):
                args, kwargs = _program_inputs(program)
                _verify(old_fn, new_fn, args, kwargs, tree, alone, names, (sample, samples))
        return new
    if isinstance(program, fx.GraphModule):
        if samples and inplace:
            raise TypeError(f"verify={verify!r} compares old and new: it cannot be combined with inplace=True "
                            "(verify a copy: inplace=False)")
        _check_aten(program)
        gm, _, tree, base = _rewritten(program, rules, irs, inplace)
        if gm is None:
            return program
        names = _output_names(program)
        for sample in range(samples):
            _verify(program, gm, *_graph_module_inputs(program), tree,
                    lambda rule: base.rewrite(tree.only(rule), False)[0], names, (sample, samples))
        return gm
    raise TypeError(f"apply takes an ExportedProgram or an fx.GraphModule, not {type(program).__name__}")


def rewrite_graph(graph: fx.Graph, rules: Union[RuleSet, Sequence[Rule], None], irs: Sequence[str],
                  subgraphs: bool = True, held: Optional[HeldOutputs] = None) -> Report:
    """Rewrite ``graph`` in place (a compiler pass: no copy, no recompile); returns the report.
    ``subgraphs=False`` leaves higher-order ops' subgraphs alone, for a compiler that hands each to
    the pass itself (inductor passes torch.cond's branches on before the graph holding them).
    ``held``: the outputs that must keep their strides (default: none)."""
    gm = graph.owning_module
    if gm is None:
        gm = fx.GraphModule(torch.nn.Module(), graph)
    where = _Where(held=held)
    with _collector_paused():
        _, tree, report = _analysed(gm, rules, irs, True, where, subgraphs=subgraphs)
        if tree.replaced():
            _rewrite_tree(gm, tree, inplace=True, recompile=False)
        del tree  # freed now, not scanned by the collection that re-enabling the collector brings
    return report


def explain(program: Any, rules: Union[RuleSet, Sequence[Rule], None] = None, *,
            ir: Optional[Union[str, Sequence[str]]] = None) -> Report:
    """What ``apply`` would replace, and every near-miss with its reason."""
    exported = isinstance(program, torch.export.ExportedProgram)
    gm = program.graph_module if exported else program
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"explain takes an ExportedProgram or an fx.GraphModule, not {type(program).__name__}")
    _check_aten(gm)
    with _collector_paused():
        _, _, report = _analysed(gm, rules, _irs(ir), inplace=False,
                                 fixed=_module_call_names(program) if exported else frozenset())
    return report


def _check_aten(gm: fx.GraphModule) -> None:
    """Patterns are matched as ATen ops: a graph of torch-level calls (``fx.symbolic_trace``'s modules,
    methods and torch functions) never matches, and said only "0 candidate sites" (found by a probe)."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    if any(isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for n in calls):
        return  # an ATen graph (ep.module() calls its guards as a module too)
    if any(n.op == "call_module" and isinstance(gm.get_submodule(n.target), fx.GraphModule) for n in calls):
        return  # split into submodules (split_module): what they hold is theirs to say
    torch_level = next((n for n in calls if n.target is not operator.getitem
                        and not isinstance(n.target, torch._ops.HigherOrderOperator)), None)
    if torch_level is not None:
        raise TypeError(f"this GraphModule calls {torch_level.target!r} ({torch_level.op}), not ATen ops (fx.symbolic_trace "
                        f"makes such graphs), and fxkern matches patterns as ATen ops: export the model with "
                        f"torch.export.export(model, args) and pass the ExportedProgram")


def _irs(ir: Optional[Union[str, Sequence[str]]]) -> Tuple[str, ...]:
    if ir is None:
        return EXPORT_IRS
    return (ir,) if isinstance(ir, str) else tuple(ir)


def _module_call_names(program: torch.export.ExportedProgram) -> FrozenSet[str]:
    """The values a preserved module call's signature names (``preserve_module_call_signature``):
    ``unflatten`` finds them by name, so no match replaces them and no view of them moves."""
    return frozenset(a.name for entry in program.module_call_graph if entry.signature is not None
                     for a in (*entry.signature.inputs, *entry.signature.outputs) if hasattr(a, "name"))


def _rename_outputs(sig: Any, renamed: Dict[str, str]) -> Any:
    if not renamed:
        return sig
    specs = []
    for spec in sig.output_specs:
        arg = spec.arg
        if hasattr(arg, "name") and arg.name in renamed:
            arg = dataclasses.replace(arg, name=renamed[arg.name])
        specs.append(dataclasses.replace(spec, arg=arg))
    return dataclasses.replace(sig, output_specs=specs)


# ---- verification ---------------------------------------------------------------


def _size_hint(s: Any) -> int:
    """A concrete size for a possibly symbolic one: its hint, or the shape environment's."""
    if not isinstance(s, torch.SymInt):
        return int(s)
    hint = getattr(s.node, "hint", None)
    if hint is not None:
        return int(hint)
    return int(s.node.shape_env.size_hint(s.node.expr))


def _concrete(val: Any, device: Optional[torch.device] = None) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    shape = [_size_hint(s) for s in val.shape]
    dev = device or val.device
    if val.dtype.is_floating_point:
        return torch.randn(shape, device=dev).to(val.dtype)
    if val.dtype == torch.bool:
        return torch.rand(shape, device=dev) > 0.5
    return torch.randint(0, 8, shape, device=dev, dtype=val.dtype)


def _mismatch(a: Any, b: Any) -> Optional[str]:
    """Why ``b`` (the rewritten program's output) is not ``a`` (the original's), or None. NaN where
    the original has NaN counts as equal: random inputs can take a model out of its domain."""
    if not isinstance(a, torch.Tensor):
        return None
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(a.dtype, 1e-5)
    try:
        torch.testing.assert_close(b, a, rtol=tol, atol=tol, equal_nan=True)
    except AssertionError as exc:
        return str(exc)
    return None


def _samples(verify: Any) -> int:
    """How many random samples ``apply``'s ``verify`` asks for: True 1, False 0, an int that many."""
    if isinstance(verify, bool):
        return int(verify)
    try:
        n = operator.index(verify)  # an int, or a NumPy integer
    except TypeError:
        raise TypeError(f"verify={verify!r}: give True, False, or a number of random samples (an int)") from None
    if n < 0:
        raise ValueError(f"verify={verify}: a number of random samples is 0 or more")
    return n


def _verify(old: Callable, new: Callable, args: Tuple, kwargs: Dict, tree: _Analysis,
            alone: Callable[[str], Callable], names: List[str], sample: Tuple[int, int] = (0, 1)) -> None:
    """Run ``old`` and ``new`` on one set of inputs (sample ``sample[0]`` of ``sample[1]``); on the
    first output that differs, rewrite with each rule's matches alone (``alone(rule)``) to say which
    rule changed it, and where it matched."""
    olds, news = _run_apart(old, args, kwargs), _run_apart(new, args, kwargs)
    if len(olds) != len(news):
        raise VerificationError(f"the rewritten program returns {len(news)} outputs, the original {len(olds)}")
    for i, (a, b) in enumerate(zip(olds, news)):
        why = _mismatch(a, b)
        if why is None:
            continue
        name = f" ({names[i]!r})" if i < len(names) else ""
        ops = {c.rule.name: c.rule.overload for c in tree.replaced()}
        rules = list(ops)
        guilty = [r for r in rules if len(rules) == 1 or _mismatch(a, _run_apart(alone(r), args, kwargs)[i]) is not None]
        if guilty:
            where = "; ".join(
                f"rule {r} ({ops[r]}), its matches at "
                + ", ".join(sorted({_location(c.match.anchor) for c in tree.replaced() if c.rule.name == r})) for r in guilty)
            blame = (f"{where}. The op computes something other than the nodes it replaced: check its kernel, "
                     f"its reference, and the order of its arguments (a region's inputs map to the op's "
                     f"arguments in order of first use)")
        else:
            blame = (f"no rule changes it alone ({', '.join(rules)}): their replacements "
                     f"together do; apply them one at a time to see which pair")
        drawn = ""
        if sample[1] > 1:
            passed = "; the ones before it passed" if sample[0] else ""
            drawn = f" (random sample {sample[0] + 1} of {sample[1]}{passed})"
        raise VerificationError(f"output {i}{name} changed after the rewrite{drawn}: {blame}.\n{why}")


def _run_apart(fn: Callable, args: Tuple, kwargs: Dict) -> List[Any]:
    """``fn``'s output leaves, run on copies of the inputs and of its buffers: a model updating a
    buffer or an input in place (BatchNorm in training, a KV cache) had its state changed by
    verification, and the second program ran from the state the first left, and differed (found by
    a probe)."""
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    args, kwargs = torch.utils._pytree.tree_map(clone, (args, kwargs))
    held = [(m, name, b) for m in (fn.modules() if isinstance(fn, torch.nn.Module) else ())
            for name, b in m._buffers.items() if b is not None]
    for m, name, b in held:
        m._buffers[name] = b.clone()
    try:
        with torch.no_grad():
            return torch.utils._pytree.tree_leaves(fn(*args, **kwargs))
    finally:
        for m, name, b in held:
            m._buffers[name] = b


def _program_inputs(program: torch.export.ExportedProgram) -> Tuple[Tuple, Dict]:
    """Random values of the program's example inputs' shapes and dtypes (of its placeholders' where it
    keeps none); non-tensor inputs as given."""
    if program.example_inputs is not None:
        args, kwargs = program.example_inputs
    else:
        user = [n for n, s in zip(program.graph.nodes, program.graph_signature.input_specs)
                if str(s.kind).endswith("USER_INPUT")]
        args, kwargs = tuple(n.meta.get("val") for n in user), {}
    return torch.utils._pytree.tree_map(_concrete, (tuple(args), dict(kwargs)))  # keywords redrawn too


def _graph_module_inputs(gm: fx.GraphModule) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """Random inputs for ``gm``, as it is called: positional, or as the structure its code takes
    (``ep.module()`` takes the model's own arguments, keywords included, and flattens them)."""
    args = [_concrete(n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    if any(a is None for a in args):
        raise VerificationError("verify needs meta['val'] on every placeholder (an exported or fake-traced graph)")
    in_spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "in_spec", None)
    if in_spec is None:
        return tuple(args), {}
    structured = torch.utils._pytree.tree_unflatten(args, in_spec)
    return tuple(structured[0]), dict(structured[1])


def _output_names(gm: fx.GraphModule) -> List[str]:
    out = gm.graph.output_node()
    return [n.name if isinstance(n, fx.Node) else repr(n) for n in torch.utils._pytree.tree_leaves(out.args[0])]
