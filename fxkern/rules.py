"""Rules: "this PyTorch pattern is that kernel op", collected in named, ordered rule sets.

``replace(pattern, target)`` registers the op for a KernelSpec target (the
pattern becomes its reference), works out how the pattern's parameters map
to the op's arguments, traces the pattern once to surface mistakes early,
and adds the rule to a RuleSet. Traced patterns are cached per (IR, dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from fxkern import matcher, patterns
from fxkern.errors import SpecError
from fxkern.spec import KernelSpec

log = logging.getLogger("fxkern")
_order = itertools.count()


@dataclass(eq=False)
class Rule:
    """One rewrite: occurrences of ``pattern`` become one call of ``op``."""

    name: str
    pattern: Callable[..., Any]
    op: Any  # OpOverloadPacket
    filter: Optional[Callable[[Any], bool]] = None
    # the pattern's arguments to trace it with, or a function of the anchor dtype returning them
    example_inputs: Optional[Union[Sequence[Any], Callable[[torch.dtype], Sequence[Any]]]] = None
    priority: Optional[int] = None
    noise: frozenset = matcher.DEFAULT_NOISE
    arg_params: Tuple[str, ...] = ()  # pattern parameter feeding each op argument, in op order
    order: int = field(default_factory=lambda: next(_order))
    irs: Optional[Tuple[str, ...]] = None  # the IRs the rule applies in (None: all)
    dtypes: Optional[FrozenSet[torch.dtype]] = None  # the anchor dtypes it applies at (None: all)
    _compiled: Dict[Tuple[Any, ...], matcher.CompiledPattern] = field(default_factory=dict, repr=False)
    _traced: Dict[Tuple[str, Any], patterns.Pattern] = field(default_factory=dict, repr=False)
    _ops_differ: Dict[Tuple[Any, ...], bool] = field(default_factory=dict, repr=False)
    _at: Dict[Tuple[Any, ...], matcher.CompiledPattern] = field(default_factory=dict, repr=False)

    @property
    def traced_once(self) -> bool:
        """Whether the pattern is traced once per IR (fixed example inputs), not once per anchor dtype."""
        return self.example_inputs is not None and not callable(self.example_inputs)

    def examples(self, dtype: torch.dtype) -> List[Any]:
        """The arguments the pattern is traced with for candidates of ``dtype``."""
        if self.example_inputs is None:
            return patterns.default_example_inputs(patterns.pattern_params(self.pattern), dtype)
        if callable(self.example_inputs):
            return list(self.example_inputs(dtype))
        return list(self.example_inputs)

    @property
    def overload(self) -> Any:
        return self.op.default if hasattr(self.op, "default") else self.op

    def compiled(self, ir: str, dtype: Optional[torch.dtype], sized: bool = False) -> matcher.CompiledPattern:
        """The pattern traced in ``ir`` for inputs of ``dtype`` (cached). ``sized``: with the numbers
        it computes from its inputs' sizes found (a second trace, made only for rules that match:
        for every rule it cost the demo a third of its time) and matched as :class:`matcher.Sized`."""
        key = self._trace_key(ir, dtype)
        if key + (sized,) not in self._compiled:
            if key not in self._traced:
                self._traced[key] = patterns.trace(self.pattern, ir, dtype=dtype or torch.float32,
                                                   example_inputs=self.examples(dtype or torch.float32))
            traced = self._traced[key]
            found = patterns.sized_sites(traced, self.pattern, self.examples(dtype or torch.float32)) if sized else {}
            if not found and sized:  # the same pattern: one object, whose candidates a matcher keeps
                self._compiled[key + (sized,)] = self.compiled(ir, dtype)
            else:
                self._compiled[key + (sized,)] = matcher.compile_pattern(dataclasses.replace(traced, sized=found), self.noise)
        return self._compiled[key + (sized,)]

    def _trace_key(self, ir: str, dtype: Optional[torch.dtype]) -> Tuple[str, Any]:
        return ir, None if self.traced_once else dtype

    @functools.cached_property
    def scalar_params(self) -> Tuple[str, ...]:
        return tuple(p.name for p in patterns.pattern_params(self.pattern) if p.kind == "scalar")

    def ops_differ_at(self, ir: str, inputs: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...],
                      values: Tuple[Tuple[str, Any], ...]) -> bool:
        """Whether the pattern, traced at these tensor (shape, dtype)s with these values of its scalar
        parameters, runs other ops than with its example values (Python control flow on a scalar:
        ``x * a if a > 1 else x / a`` matched a model's ``x / 2`` and the op ran ``x * 2``; found by a
        probe). A trace that fails cannot tell: False. Cached per sizes and values (a branch may read
        both: keyed by values alone, one match's answer served another's sizes; found by a review)."""
        key = (ir, inputs, values)
        if key not in self._ops_differ:
            given, sizes = dict(values), iter(inputs)
            params = patterns.pattern_params(self.pattern)
            examples = [_meta(*next(sizes)) if p.kind == "tensor" else v
                        for p, v in zip(params, self.examples(inputs[0][1]))]
            at_values = patterns._trace_quietly(self.pattern, ir, params, [given.get(p.name, v) for p, v in zip(params, examples)])
            differ = False
            if at_values is not None:
                # most patterns run the ops they were traced with: one trace; else at the example values too
                traced = next((t for (i, _), t in self._traced.items() if i == ir), None)
                ops = [n.target for n in at_values]
                if traced is None or ops != [n.target for n in patterns._op_nodes(traced.graph)]:
                    at_examples = patterns._trace_quietly(self.pattern, ir, params, examples)
                    differ = at_examples is not None and ops != [n.target for n in at_examples]
            _remember(self._ops_differ, key, differ)
        return _recent(self._ops_differ, key)

    def compiled_at(self, ir: str, inputs: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...],
                    scalars: Tuple[Tuple[str, Any], ...] = ()) -> matcher.CompiledPattern:
        """The pattern traced in ``ir`` with tensors of these (shape, dtype) and these (name, value)
        scalars (cached; the others at their example values): the numbers it computes from its inputs'
        sizes are then literals, those of a match's own inputs. A match's captured widths go with its
        sizes (``x[..., :rotary_dim]`` traced at the match's tables needs the match's rotary_dim)."""
        key = (ir, inputs, scalars)
        if key not in self._at:
            given, values = iter(inputs), dict(scalars)
            examples = [_meta(*next(given)) if p.kind == "tensor" else values.get(p.name, v)
                        for p, v in zip(patterns.pattern_params(self.pattern), self.examples(inputs[0][1]))]
            traced = patterns.trace(self.pattern, ir, example_inputs=examples)
            _remember(self._at, key, matcher.compile_pattern(traced, self.noise))
        return _recent(self._at, key)


# Entries a rule keeps per match sizes (``compiled_at``, ``ops_differ_at``): a model compiled for each new
# sequence length (torch.compile, static shapes) meets new sizes for as long as it serves, and each
# entry holds a traced graph. Past the bound the least recently used entry goes (retraced if its
# sizes come back).
AT_SIZES = 256


def _remember(cache: Dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= AT_SIZES:
        del cache[next(iter(cache))]  # the least recently used: dicts keep their insertion order
    cache[key] = value


def _recent(cache: Dict[Any, Any], key: Any) -> Any:
    """``cache[key]``, moved to the end of the cache's order: the most recently used. Two threads may
    move one key at once: the second finds it gone from its place, and puts it back (a pop that raised
    KeyError there was found by a review)."""
    value = cache[key]
    cache.pop(key, None)
    cache[key] = value
    return value


def trace_together(rules: Sequence[Rule], ir: str, dtype: torch.dtype) -> None:
    """Trace in one go the rules not yet traced in ``ir`` for ``dtype``, where that is cheaper than
    one by one (the IRs made by ``run_decompositions``: :func:`patterns.decompose_together`). A rule
    whose trace from there fails is left to trace alone, and say why then."""
    if ir not in ("core_aten", "tensorrt"):
        return
    todo = [r for r in rules if (r.irs is None or ir in r.irs) and r._trace_key(ir, dtype) not in r._traced]
    if len(todo) < 2:
        return
    examples = [r.examples(dtype) for r in todo]
    graphs = patterns.decompose_together([(r.pattern, ex) for r, ex in zip(todo, examples)], ir)
    for rule, ex, graph in zip(todo, examples, graphs):
        if graph is not None:
            try:
                rule._traced[rule._trace_key(ir, dtype)] = patterns.trace(rule.pattern, ir, dtype=dtype, example_inputs=ex,
                                                                          graph=graph)
            except SpecError:
                pass


def _meta(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


class RuleSet:
    """An ordered, named collection of rules."""

    def __init__(self, name: Optional[str] = None, rules: Sequence[Rule] = ()):
        self.name = name or "rules"
        self._rules: Dict[str, Rule] = {}
        self.version = 0  # bumped on every change, so caches keyed on a rule set notice
        for r in rules:
            self.add(r)

    def add(self, rule: Rule) -> Rule:
        if rule.name in self._rules and self._rules[rule.name] is not rule:
            raise SpecError(f"rule set {self.name!r} already has a rule named {rule.name!r}; remove it first or pick another name")
        self._rules[rule.name] = rule
        self.version += 1
        return rule

    def remove(self, name: str) -> Rule:
        self.version += 1
        return self._rules.pop(name)

    def __getitem__(self, name: str) -> Rule:
        return self._rules[name]

    def __contains__(self, name: object) -> bool:
        return name in self._rules

    def __iter__(self) -> Iterator[Rule]:
        return iter(list(self._rules.values()))

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        return f"RuleSet({self.name!r}, {list(self._rules)})"


_DEFAULT = RuleSet("default")


def default_rules() -> RuleSet:
    """The global rule set that ``replace`` adds to and ``apply`` uses by default."""
    return _DEFAULT


def replace(
    pattern: Callable[..., Any],
    target: Any,
    *,
    name: Optional[str] = None,
    rules: Optional[RuleSet] = None,
    filter: Optional[Callable[[Any], bool]] = None,
    example_inputs: Optional[Union[Sequence[Any], Callable[[torch.dtype], Sequence[Any]]]] = None,
    priority: Optional[int] = None,
    noise: Optional[Sequence[str]] = None,
    irs: Optional[Sequence[str]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    past_limits: str = "reference",
) -> Rule:
    """Make a rule that replaces every safe occurrence of ``pattern`` by one call of ``target``.

    ``target`` is a KernelSpec (an op ``fxkern::<name>`` is registered with the
    pattern as its reference, which also runs calls past the kernel's 32-bit sizes; a ``name``
    with ``::`` picks the namespace) or an existing op.
    ``noise`` lists what may sit inside a match without breaking it:
    ``"views"`` and ``"clones"`` (default) and ``"casts"`` (same-dtype ``to``).
    ``example_inputs`` are the pattern's arguments to trace it with (one trace per IR), or a function
    of the dtype of the graph's candidate outputs returning them (one trace per IR and dtype), for a
    pattern whose graph holds its inputs' dtype (``.to(input_dtype)``).
    ``irs`` limits the rule to some pattern IRs (``fxkern.patterns.TRACERS``), e.g. leaving out
    ``"inductor"`` for a replacement that inductor's own fusion beats, or a pattern that cannot be
    traced in every IR. ``dtypes`` limits it to candidates whose output has one of these dtypes: a
    kernel for 16-bit values only, or a pattern whose float32 trace is another rule's (casts to
    float32 and back vanish there), is then not tried at the others, which costs no walks and
    leaves no near-misses in the report. ``past_limits`` is the registered op's (``cuda_kernel_op``):
    ``"split"`` for a kernel whose outputs are independent along every axis but the last (rows,
    elements), so calls past its 32-bit sizes run as several launches rather than the pattern.
    """
    if not callable(pattern):
        raise SpecError(f"a pattern must be a function, got {pattern!r}")
    if filter is not None and not callable(filter):
        raise SpecError(f"filter= must be a function of the match returning True to replace it, got {filter!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise SpecError(f"priority= must be an int (lower wins an overlap), got {priority!r}")
    if rules is not None and not isinstance(rules, RuleSet):
        raise SpecError(f"rules= must be a fxkern.RuleSet, got {type(rules).__name__}: make one with RuleSet('name')")
    rule_name = (name or pattern.__name__).split("::")[-1]
    if not rule_name.isidentifier():
        raise SpecError(f"rule name {rule_name!r} is not an identifier; pass name= (a lambda has no usable name)")
    policy = frozenset(noise) if noise is not None else matcher.DEFAULT_NOISE
    unknown = policy - matcher.ALL_NOISE
    if unknown:
        raise SpecError(f"noise={sorted(unknown)} is not one of {sorted(matcher.ALL_NOISE)}")
    if isinstance(target, KernelSpec):
        from fxkern.ops import cuda_kernel_op

        op_name = name if name and "::" in name else f"fxkern::{rule_name}"
        # past the kernel's 32-bit sizes the pattern runs instead: the model ran it before the rewrite
        op = cuda_kernel_op(op_name, target, reference=_reference(pattern, target), past_limits=past_limits)
    elif past_limits != "reference":
        raise SpecError(f"past_limits= is for a KernelSpec target, whose op replace registers; {target!r} is an "
                        f"op already: pass past_limits= to cuda_kernel_op where it is registered")
    else:
        op = target
    overload = op.default if hasattr(op, "default") else op
    if not isinstance(overload, torch._ops.OpOverload):
        raise SpecError(f"replace target must be a KernelSpec or a torch op, got {target!r}")
    params = patterns.pattern_params(pattern)
    arg_params = _map_params(pattern, params, overload)
    if irs is not None:
        irs = tuple(irs)
        bad = [ir for ir in irs if ir not in patterns.TRACERS]
        if bad or not irs:
            raise SpecError(f"irs={list(irs)}: name one or more of {sorted(patterns.TRACERS)}")
    if dtypes is not None:
        dtypes = frozenset(dtypes)
        if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
            raise SpecError(f"dtypes={sorted(map(str, dtypes))}: name one or more torch dtypes (torch.bfloat16, ...)")
    rule = Rule(rule_name, pattern, op, filter, example_inputs, priority, policy, arg_params, irs=irs, dtypes=dtypes)
    # trace once now: a broken pattern fails here, not inside apply
    compiled = rule.compiled("export" if irs is None or "export" in irs else irs[0], torch.float32)
    returns = overload._schema.returns
    if all(str(r.type) == "Tensor" for r in returns) and len(returns) != len(compiled.outputs):
        raise SpecError(f"pattern {pattern.__name__} returns {len(compiled.outputs)} tensor(s) but {overload} returns "
                        f"{len(returns)}; make the spec's outputs (or the op's schema) match what the pattern returns")
    _check_outputs(rule, overload, "export" if irs is None or "export" in irs else irs[0])
    (rules if rules is not None else _DEFAULT).add(rule)
    return rule


def _check_outputs(rule: Rule, overload: Any, ir: str) -> None:
    """The op, run (fake) on the pattern's example inputs, must give what the pattern gives there: a
    pattern summing rows against an op declaring its output ``SameAs`` the input registered, and
    every match was then refused for the output's shape (found by a probe). An op that refuses the
    examples cannot tell."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    traced = rule._traced[rule._trace_key(ir, torch.float32)]
    want = [o.meta.get("val") for o in traced.outputs]
    given = dict(zip((p.name for p in traced.params), rule.examples(torch.float32)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            args = [mode.from_tensor(given[n]) if isinstance(given[n], torch.Tensor) else given[n] for n in rule.arg_params]
            got = overload(*args)
    except Exception:  # noqa: BLE001 - the op's own checks: it may take other inputs than the examples
        return
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and (g.dtype, tuple(g.shape)) != (w.dtype, tuple(w.shape)):
            raise SpecError(f"pattern {rule.pattern.__name__} returns {w.dtype} {tuple(w.shape)} at its example inputs, "
                            f"where {overload} returns {g.dtype} {tuple(g.shape)} (output {i}): no match could be "
                            f"replaced; make the spec's outputs (shape, dtype_from) say what the pattern computes")


def rule(target: Any, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator form of :func:`replace`; returns the pattern function unchanged."""
    if not (isinstance(target, (KernelSpec, torch._ops.OpOverload, torch._ops.OpOverloadPacket))):
        # a bare @fxkern.rule took the pattern as its target and registered nothing (found by a probe)
        raise SpecError(f"fxkern.rule takes the op or KernelSpec the pattern becomes, got {target!r}: "
                        f"write @fxkern.rule(my_op) or @fxkern.rule(my_spec)")

    def register(pattern: Callable[..., Any]) -> Callable[..., Any]:
        replace(pattern, target, **options)
        return pattern

    return register


def _reference(pattern: Callable[..., Any], spec: KernelSpec) -> Callable[..., Any]:
    """The pattern as its op's reference (the CPU impl), called in the op's argument order. A spec may
    declare the pattern's parameters in another order: the rule maps them by name, and the reference
    must too (it computed pattern(x=y, y=x) on CPU; found by a review)."""
    names = tuple(d.name for d in spec.inputs or ())
    pnames = tuple(p.name for p in patterns.pattern_params(pattern))
    if names == pnames or sorted(names) != sorted(pnames):
        return pattern

    def reference(*args: Any) -> Any:
        return pattern(**dict(zip(names, args)))

    reference.__qualname__ = reference.__name__ = pattern.__name__
    return reference


def _map_params(pattern: Callable[..., Any], params: Sequence[patterns.Param], overload: Any) -> Tuple[str, ...]:
    args = overload._schema.arguments
    names = [a.name for a in args]
    pnames = [p.name for p in params]
    if len(args) != len(params):
        raise SpecError(
            f"pattern {pattern.__name__}{tuple(pnames)} has {len(params)} parameters but {overload} takes "
            f"{len(args)} arguments {tuple(names)}"
        )
    mapping = tuple(names) if set(names) == set(pnames) else tuple(pnames)
    by_name = {p.name: p for p in params}
    for arg, pname in zip(args, mapping):
        p = by_name[pname]
        is_tensor = str(arg.type) == "Tensor"
        if is_tensor != (p.kind == "tensor"):
            kind = "a Tensor" if is_tensor else f"a {arg.type}"
            raise SpecError(
                f"pattern {pattern.__name__}: parameter {pname!r} maps to {overload}'s argument {arg.name!r}, "
                f"which is {kind}; annotate scalars as float/int/bool and keep the orders aligned"
            )
    return mapping
