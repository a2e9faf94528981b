"""``fxkern.backend(...)``: a torch.compile backend that applies fxkern's rules, then hands on.

The rules run on the ATen graphs the inner backend compiles, in their IR:

* ``inner="inductor"``: as inductor's ``post_grad_custom_pre_pass``, on its
  post-grad graphs (forward, backward and inference alike), with patterns
  traced under inductor's decompositions. The pass has a ``uuid`` built from
  fxkern's sources and the rule set, so inductor's FX graph cache stays valid
  across processes and misses when the rules change.
* ``inner="tensorrt"``: Torch-TensorRT's backend, which lowers the graph
  itself; fxkern's lowering pass (:mod:`fxkern.tensorrt`) applies these
  rules inside it, and the ops become plugin layers. Torch-TensorRT's
  settings go in ``options={...}`` (e.g. ``{"min_block_size": 1}``).
* ``inner="aot_eager"`` / ``"eager"`` or a callable ``(gm, example_inputs)``:
  through aot_autograd, on its forward, backward and inference graphs, with
  patterns traced as aot_autograd traces (no-op casts leave no node) and as
  torch.export does; a callable receives the rewritten graph.

Training needs nothing special: a rewrite never changes a value (the op
computes what the pattern computes), graphs are rewritten after autograd
split them, and a match whose intermediate the backward reads is refused as
escaping. Changing the rule set after compiling recompiles the affected
graphs at their next call.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

import torch.fx as fx

from fxkern.errors import SpecError
from fxkern import region
from fxkern.region import site_count, sites
from fxkern.rewrite import HeldOutputs, Report, rewrite_graph
from fxkern.rules import Rule, RuleSet, default_rules

log = logging.getLogger("fxkern")

INNER_NAMES = ("inductor", "aot_eager", "eager", "tensorrt", "torch_tensorrt")
_SOURCES = sorted(str(p) for p in Path(__file__).resolve().parents[1].rglob("*.py"))


def _op_key(op: Any) -> tuple:
    """An op as the rewrite's result depends on it: its name, its schema and, for an fxkern op, its spec."""
    from fxkern.ops import _REGISTRY

    schema = getattr(op, "_schema", None)
    entry = _REGISTRY.get(schema.name) if schema is not None else None
    return str(op), str(schema), entry.identity if entry is not None else None


def _rule_key(rules: Sequence[Rule]) -> str:
    """What decides the rewrite: rule order and names, options, the pattern and the filter as
    re-registration compares functions (code, the names it loads, constants, closures), and the
    target op with its schema and, for an fxkern op, its spec. Bytecode alone let a pattern edited
    from sin to cos, or a rule set differing only in its filter, reuse a cached graph (found by a
    review). The region sites recorded so far count too: without them a graph cached before a
    region was added, or with another target, ran the old code (found by a usability test)."""
    from fxkern.ops import _fn_id

    h = hashlib.sha256()
    for r in rules:
        h.update(repr((r.name, r.priority, sorted(r.noise), r.arg_params, r.irs, _fn_id(r.pattern), _fn_id(r.filter),
                       _op_key(r.overload))).encode())
    for key in sorted(repr((s.filename, s.first, s.last, s.statements, _op_key(s.op))) for s in sites()):
        h.update(key.encode())
    return h.hexdigest()


try:  # inductor caches compiled graphs only around passes of this type with a uuid
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # older torch: a plain object still runs, without the FX graph cache
    _PassBase = object


class _Pass(_PassBase):
    """Inductor's custom post-grad pass: ``__call__(graph)``, and a ``uuid()`` for its FX graph cache."""

    def __init__(self, owner: "FxkernBackend", facts: Optional[region.CompileFacts] = None):
        self.owner = owner
        self.facts = facts  # kept for the backward, which inductor compiles at the first backward call

    def __call__(self, graph: fx.Graph) -> None:
        # inductor runs this pass on each torch.cond branch before the graph holding it: analysing
        # the branches again from there cost a second analysis and found nothing new. Outputs keep
        # their strides where something else reads them. In the graph it compiles (whose outputs it
        # marks user-visible or not), an unmarked output, a value saved for the backward, takes the
        # strides of its node's value, which the op's result changes. A graph with no marks is a
        # torch.cond branch, whose values inductor works out again: every output is held, and what
        # the op's result reaches too (a transposed match failed inductor's check that both
        # branches return the same strides).
        (output,) = graph.find_nodes(op="output")
        marked = output.meta.get("user_visible_output_idxs")
        if marked is not None:
            held = HeldOutputs(frozenset(marked), "the graph's output", "the backward reads it as a saved value, "
                               "in the graph's strides", direct=True)
        else:
            held = HeldOutputs(frozenset(), "the output", "inductor compiles this graph alone, as a torch.cond branch "
                               "whose other branch returns the graph's strides")
        self.owner._rewrite(graph, ("inductor",), self.facts, subgraphs=False, held=held)

    def uuid(self) -> str:
        from torch._inductor.custom_graph_pass import get_hash_for_files

        files = get_hash_for_files(tuple(_SOURCES))
        # the facts too: a graph compiled without knowing a site's removed calls must not be reused
        # by a compile that knows them (found by a review), nor one of calls in no region block
        return hashlib.sha256(files + self.owner.rules_key().encode()
                              + (self.facts.key() if self.facts is not None else "").encode()).hexdigest()


class FxkernBackend:
    """The callable torch.compile receives; see :func:`backend`."""

    def __init__(self, rules: Union[RuleSet, Sequence[Rule], None], inner: Any,
                 report: Optional[Callable[[Report], None]], options: dict):
        self.rules = rules
        self.inner = inner
        self.report = report
        self.options = options
        self.reports: List[Report] = []

    def current_rules(self) -> List[Rule]:
        return list(self.rules if self.rules is not None else default_rules())

    def rules_key(self) -> str:
        return _rule_key(self.current_rules())

    def _rewrite(self, graph: fx.Graph, irs: Sequence[str], facts: Optional[region.CompileFacts] = None,
                 subgraphs: bool = True, held: Optional[HeldOutputs] = None) -> None:
        with region.compiling(facts):
            report = rewrite_graph(graph, self.current_rules(), irs, subgraphs, held)
        self.reports.append(report)
        if report.matches:
            log.info("fxkern: replaced %d subgraphs (%s)", len(report.matches),
                     ", ".join(sorted({m.rule for m in report.matches})))
        if self.report is not None:
            self.report(report)

    def fingerprint(self) -> Any:
        """Cheap to read on every call: which rule set, at which version (or which rules), and how many
        region sites have been recorded (a block first run after the compile is a new instruction)."""
        rs = self.rules if self.rules is not None else default_rules()
        if isinstance(rs, RuleSet):
            return id(rs), rs.version, site_count()
        return tuple(id(r) for r in rs), site_count()

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        from torch._guards import TracingContext, tracing

        seen = self.fingerprint()
        # dynamo's context for this graph (its fake mode and symbolic shapes): a recompile outside it
        # specialised a dynamic graph to its first example's sizes (found by a review)
        context = TracingContext.try_get()
        facts = region.compile_facts(gm)  # what tells a region's whole run from part of it, read now
        compiled = self._compile(gm, example_inputs, facts)

        def current() -> Callable[..., Any]:
            nonlocal compiled, seen, facts
            now = self.fingerprint()
            if now != seen:  # the rule set changed since this graph was compiled
                log.info("fxkern: rule set or region sites changed; recompiling a graph")
                facts = region.compile_facts(gm, facts.cut)  # a site recorded since counts too (found by a review)
                with tracing(context):
                    compiled, seen = self._compile(gm, example_inputs, facts), now
            return compiled

        def run(*args: Any) -> Any:  # dynamo calls a backend's result with unpacked arguments
            return current()(*args)

        return run

    def _compile(self, gm: fx.GraphModule, example_inputs: List[Any],
                 facts: Optional[region.CompileFacts] = None) -> Callable[..., Any]:
        inner = self.inner
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            # through config_patches, which compile_fx applies to each graph's compile, the backward's
            # too: a config.patch around this call has ended by the time inductor compiles the
            # backward, whose graphs went without the rules (found by a review)
            patches = {**(self.options.get("config_patches") or {}), "post_grad_custom_pre_pass": _Pass(self, facts)}
            return compile_fx(gm, example_inputs, config_patches=patches)
        if inner in ("tensorrt", "torch_tensorrt"):
            with region.compiling(facts):  # Torch-TensorRT lowers and runs fxkern's pass inside this call
                return self._compile_tensorrt(gm, example_inputs)
        from torch._dynamo.backends.common import aot_autograd

        if inner in ("eager", "aot_eager"):
            def finish(g: fx.GraphModule, ex: List[Any]) -> Callable[..., Any]:
                return g.forward
        else:  # a callable: backend() checked the name
            finish = inner

        from torch._functorch.aot_autograd import make_boxed_func

        def rewrite_then(g: fx.GraphModule, ex: List[Any]) -> Callable[..., Any]:
            self._rewrite(g.graph, ("aot", "export"), facts)
            g.recompile()
            fn = finish(g, ex)
            return fn if getattr(fn, "_boxed_call", False) else make_boxed_func(fn)  # aot calls with a list

        return aot_autograd(fw_compiler=rewrite_then, bw_compiler=rewrite_then, inference_compiler=rewrite_then,
                            decompositions=self.options.get("decompositions", {}))(gm, example_inputs)


    def _compile_tensorrt(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        """Torch-TensorRT lowers the graph itself; fxkern's lowering pass runs inside with these rules."""
        from fxkern import tensorrt

        trt_backend = tensorrt.compile_backend()

        def record(report: Report) -> None:
            self.reports.append(report)
            if self.report is not None:
                self.report(report)

        with tensorrt.using(self.current_rules(), record):
            return trt_backend(gm, example_inputs, options=dict(self.options.get("options", {})))


def backend(rules: Union[RuleSet, Sequence[Rule], None] = None, inner: Any = "inductor", *,
            report: Optional[Callable[[Report], None]] = None, **options: Any) -> FxkernBackend:
    """A torch.compile backend that applies ``rules`` (default: the default rule set, read at
    each compile) and then compiles with ``inner``. ``report(r)`` is called with the
    :class:`~fxkern.Report` of every graph rewritten; ``backend.reports`` keeps them too.
    ``options``: ``config_patches`` and ``decompositions`` (inductor), ``options`` (Torch-TensorRT).
    Arguments are checked here, not at the first compile, where dynamo would wrap the error."""
    if rules is not None and not isinstance(rules, RuleSet) and not (
            isinstance(rules, (list, tuple)) and all(isinstance(r, Rule) for r in rules)):
        raise SpecError(f"fxkern.backend: rules must be a fxkern.RuleSet or a list of Rules, not {rules!r}")
    if isinstance(inner, str) and inner not in INNER_NAMES:
        raise SpecError(f"fxkern.backend: inner={inner!r} is not supported; use one of {', '.join(map(repr, INNER_NAMES))} "
                        f"or a callable (gm, example_inputs) -> callable")
    if not isinstance(inner, str) and not callable(inner):
        raise SpecError(f"fxkern.backend: inner must be a backend name or a callable, not {type(inner).__name__}")
    if report is not None and not callable(report):
        raise SpecError(f"fxkern.backend: report must be a callable taking a fxkern.Report, not {report!r}")
    unknown = sorted(set(options) - {"config_patches", "decompositions", "options"})
    if unknown:
        raise SpecError(f"fxkern.backend: unknown option(s) {unknown}; it takes config_patches=, decompositions= "
                        f"(inductor) and options= (Torch-TensorRT)")
    if options.get("config_patches"):  # checked, and dashed names ("max-autotune") passed as inductor spells them
        options = {**options, "config_patches": _inductor_patches(options["config_patches"], None,
                                                                  "fxkern.backend(config_patches=...)")}
    if inner in ("tensorrt", "torch_tensorrt"):  # here, not at the first call, where dynamo wraps the error
        from fxkern.errors import TensorRTUnavailable
        from fxkern.tensorrt import available

        status = available()
        if not status:
            raise TensorRTUnavailable(f"fxkern.backend(inner={inner!r}): {status.reason}")
    return FxkernBackend(rules, inner, report, options)


def _registered(gm: fx.GraphModule, example_inputs: List[Any], options: Optional[dict] = None,
                mode: Optional[str] = None) -> Callable[..., Any]:
    """``torch.compile(model, backend="fxkern")``: the default rule set, inductor after it;
    ``options=`` and ``mode=`` are inductor's, as ``backend="inductor"`` takes them (dynamo passes
    them, and both failed: found by two probes)."""
    patches = _inductor_patches(options, mode)
    return backend(config_patches=patches)(gm, example_inputs) if patches else backend()(gm, example_inputs)


def _inductor_patches(options: Optional[dict], mode: Optional[str], where: str = 'torch.compile(backend="fxkern")') -> dict:
    """Inductor's config patches for ``options`` and ``mode``, each name checked (a misspelt one failed
    at the first call, inside dynamo's error, or did nothing)."""
    from torch._inductor import config, list_mode_options

    patches = {}
    if mode is not None:
        try:
            patches.update(list_mode_options(mode))
        except RuntimeError as exc:
            raise SpecError(f"{where}, mode={mode!r}: {exc}") from None
    patches.update({k.replace("-", "_"): v for k, v in (options or {}).items()})  # "max-autotune" too
    known = set(config.get_config_copy())
    unknown = sorted(k for k in patches if k not in known and k.split(".")[0] not in known)
    if unknown:
        raise SpecError(f"{where}: {unknown} are not inductor config options"
                        + (" (the string backend passes options= to inductor; fxkern.backend(...) takes fxkern's)"
                           if where.startswith("torch.compile") else ""))
    return patches


try:
    from torch._dynamo import register_backend

    register_backend(_registered, name="fxkern")
except Exception as exc:  # an older or stripped torch: the callable form still works
    log.debug("fxkern: could not register the 'fxkern' backend name: %s", exc)
