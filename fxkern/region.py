"""``with fxkern.region(target):`` marks a block of model code as one replaceable region.

The mark is the block's place in the source: entering the context records
the file and the line span of the ``with`` statement (read with ``ast``).
Under torch.export's default (non-strict) tracing, the block runs in Python
and the nodes it traces are tagged with their run of the block
(``node.meta["custom"]``, which decompositions keep): a region in a helper
function, whose frame non-strict export leaves out of stack traces, is found
as well as one in ``forward``. Elsewhere (dynamo graphs, strict export) the
nodes are found by their ``stack_trace`` lines, each mapped to the top-level
statement of the block holding it, so a call written over several lines is
one piece. Under dynamo the context is skipped (frame inspection cannot be
traced): the site is the one recorded when the block last ran outside the
compiler, in eager or under torch.export. There a graph may hold a piece of
a run, not all of it (a graph break inside the block, a torch.cond branch
inductor hands over alone, a call the compiler removed): what the backend
reads of dynamo's graph (:class:`CompileFacts`) refuses those, and two runs
of a loop are told apart by where each call starts in the source. At run
time the context does nothing.

``apply`` replaces every region it finds, whatever rule set it is given: the
region's inputs (values made outside and used inside, in order of first use in
torch.export's graph, which compiled graphs are held to: :func:`in_call_order`, :func:`unordered_inputs`)
and outputs (values made inside and used after it, in graph order) map to
the op's tensor arguments and returns by position.
"""

from __future__ import annotations

import ast
import bisect
import contextlib
import contextvars
import functools
import itertools
import linecache
import logging
import operator
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.fx as fx

from fxkern.errors import SpecError
from fxkern.spec import KernelSpec

log = logging.getLogger("fxkern")


@dataclass(frozen=True)
class RegionSite:
    filename: str
    first: int  # the `with` line
    last: int  # the block's last line
    op: Any
    statements: Tuple[int, ...] = ()  # first line of each top-level statement of the block

    @property
    def label(self) -> str:
        return f"region@{self.filename.rsplit('/', 1)[-1]}:{self.first}"

    @property
    def tag(self) -> str:
        """What its runs' nodes are tagged with: the same in every process (a saved program keeps its
        tags), and distinct for each target one line runs with."""
        return f"{self.filename}:{self.first}:{self.op}"

    def statement(self, line: int) -> int:
        """The index of the block's top-level statement holding ``line``."""
        return max(bisect.bisect_right(self.statements, line) - 1, 0)


_SITES: Dict[Tuple[str, int, Any], RegionSite] = {}
_SITES_LOCK = threading.Lock()  # threads tracing models at once record each site once
_RUNS = itertools.count()
TAG = "fxkern_region"  # node.meta["custom"][TAG]: "<site tag>#<run>"


def sites() -> List[RegionSite]:
    return list(_SITES.values())


def site_count() -> int:
    """How many sites have been recorded (the backend reads it on every call: a new one recompiles)."""
    return len(_SITES)


def region(target: Any, *, name: Optional[str] = None, reference: Any = None) -> Any:
    """Mark the code inside the ``with`` block as one call of ``target`` (an op, or a KernelSpec
    registered as ``fxkern::<name>``; ``reference`` becomes its CPU impl, and runs CUDA calls past
    the kernel's 32-bit sizes).

    Under dynamo it is ``contextlib.nullcontext()``, which dynamo traces through, graph breaks
    included (a context object of its own made dynamo skip the whole frame at a graph break inside
    it; found by a review); the site is the one recorded when the block last ran outside dynamo."""
    import torch

    if not isinstance(target, (KernelSpec, torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        raise SpecError(f"fxkern.region: the target must be a torch op (torch.ops.ns.name) or a KernelSpec, "
                        f"not {target!r}")
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    return _Region(target, name, reference)


class _Region:
    """The context ``region`` returns outside dynamo: records the site, and tags what a tracer traces."""

    def __init__(self, target: Any, name: Optional[str], reference: Any):
        self.target, self.name, self.reference = target, name, reference

    def __enter__(self) -> "_Region":
        frame = sys._getframe(1)
        filename, line = frame.f_code.co_filename, frame.f_lineno
        # a KernelSpec (unhashable) by its kernel: two specs on one line are two sites (the second one's
        # registration then asks for a name= of its own). Its strings, not repr(spec): this runs on
        # every call of the block in eager, and a str keeps its hash
        spec = self.target
        target = (spec.kernel_name, spec.kernel_source) if isinstance(spec, KernelSpec) else spec
        key = (filename, line, target, self.name)
        with _SITES_LOCK:
            site = _SITES.get(key)
            if site is None:
                last, statements = _block(filename, line)
                site = _SITES[key] = RegionSite(filename, line, last, self._op(filename, line), statements)
        self._graph = _tracing_graph()
        if self._graph is not None:
            self._tag = f"{site.tag}#{next(_RUNS)}"
            self._last = next(iter(reversed(self._graph.nodes)), None)  # torch 2.11: an iterable, not an iterator
        return self

    def __exit__(self, *exc: Any) -> None:
        graph = getattr(self, "_graph", None)
        if graph is None:
            return None
        self._graph = None
        if exc and exc[0] is not None:  # the block did not finish: its nodes are no run of it
            return None
        for node in reversed(graph.nodes):  # the nodes this run of the block traced
            if node is self._last:
                break
            if node.op == "call_function":
                node.meta["custom"] = {**(node.meta.get("custom") or {}), TAG: self._tag}
        return None

    def _op(self, filename: str, line: int) -> Any:
        if isinstance(self.target, KernelSpec):
            from fxkern.ops import cuda_kernel_op

            name = self.name or f"region_{re.sub(r'[^0-9A-Za-z_]', '_', filename.rsplit('/', 1)[-1])}_{line}"
            # the reference, where given, is the block's own code: it also runs calls past the kernel's sizes
            return cuda_kernel_op(name if "::" in name else f"fxkern::{name}", self.target, reference=self.reference,
                                  past_limits="raise" if self.reference is None else "reference")
        return self.target


def _tracing_graph() -> Optional[fx.Graph]:
    """The graph torch.export's non-strict tracing is building, or None (eager, or no tracer)."""
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    mode = get_proxy_mode()
    tracer = getattr(mode, "tracer", None)
    return getattr(tracer, "graph", None)


def _block(filename: str, line: int) -> Tuple[int, Tuple[int, ...]]:
    """Last line of the ``with`` statement that starts at ``line``, and the first line of each
    top-level statement of its body."""
    source = "".join(linecache.getlines(filename))
    if not source:
        raise SpecError(f"fxkern.region at {filename}:{line}: the source is not readable (code run through exec, "
                        f"or a .pyc without its .py); the region is found by its place in the source")
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise SpecError(f"fxkern.region at {filename}:{line}: cannot read the source ({exc})") from exc
    for node in ast.walk(tree):
        # the with's own lines, or its one line when the block is on it (`with fxkern.region(op): y = f(x)`)
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno <= line and (
                line < node.body[0].lineno or line == node.lineno == node.body[0].lineno):
            return node.end_lineno, tuple(stmt.lineno for stmt in node.body)
    raise SpecError(f"fxkern.region at {filename}:{line}: use it as `with fxkern.region(...):`")


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _line_in_site(node: fx.Node, site: RegionSite) -> Optional[int]:
    """The line of the innermost frame of ``node``'s stack trace inside the site, or None."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [int(n) for f, n in _FRAME.findall(trace) if f == site.filename and site.first < int(n) <= site.last]
    return lines[-1] if lines else None


@dataclass(frozen=True)
class CompileFacts:
    """What a backend learns of a dynamo graph when dynamo hands it over, for the graphs compiled
    from it (forward, backward, the subgraphs inductor passes on one by one): where dynamo cut it
    (:func:`dynamo_cut`), the traced calls written in each site's block (``(node name, graph id)``,
    as later nodes' ``from_node`` names them), the sites with calls inside a higher-order op's
    subgraph (a torch.cond branch, a nested_compile_region), and the source places of the calls in
    a site's block (``(site tag, position)``)."""

    cut: Tuple[Tuple[str, int], ...] = ()
    calls: Dict[str, frozenset] = field(default_factory=dict)
    in_subgraph: frozenset = frozenset()
    places: Tuple[str, ...] = ()
    # each call in a site's block by its place in dynamo's graph, the order Python ran them in
    # (``(node name, graph id)``); a later graph may move calls (inductor's post-grad graph does)
    order: Dict[Tuple[str, int], int] = field(default_factory=dict)
    # what each such call reads from outside its site's block, in argument order: another call
    # (``(node name, graph id)``) or dynamo's i-th placeholder (``("placeholder", i)``)
    reads: Dict[Tuple[str, int], Dict[str, Tuple[Any, ...]]] = field(default_factory=dict)
    placeholders: Tuple[Any, ...] = ()  # (dtype, rank) of each placeholder's tensor, or None

    def key(self) -> str:
        """The same in every process (graph ids left out), for a compile cache's key. It holds the
        places: inductor's FX graph cache keys a graph by its ops, not its stack traces, so two graphs
        of the same ops, one written inside a region and one not, shared a cached compile (found by a
        test)."""
        calls = sorted((tag, sorted(name for name, _ in names)) for tag, names in self.calls.items())
        order = [name for (name, _), _ in sorted(self.order.items(), key=lambda item: item[1])]
        reads = sorted((name, tag, [k if k[0] == "placeholder" else k[0] for k in read])
                       for (name, _), tags in self.reads.items() for tag, read in tags.items())
        return repr((self.cut, calls, sorted(self.in_subgraph), self.places, order, reads, self.placeholders))


_COMPILE: contextvars.ContextVar[Optional[CompileFacts]] = contextvars.ContextVar("fxkern_compile", default=None)
_RESUMED = re.compile(r'File "([^"]+)", line \d+, in torch_dynamo_resume_in_\w+_at_(\d+)')


# Higher-order ops whose subgraphs aot_autograd inlines into the graph it hands on (activation
# checkpointing, dynamo's own wrap): a block calling them is still whole there
_INLINED = {"tag_activation_checkpoint", "wrap"}
# Calls a compiler may drop with no change in value when they are no-ops (a same-dtype cast, a
# clone it need not make, dropout in eval). Each is idempotent, so where one was folded into a
# constant instead, the op computing the block from that constant applies it twice, to the same value
_NO_OP_NAMES = {"clone", "contiguous", "detach", "to", "type", "type_as", "float", "half", "bfloat16", "double",
                "dropout", "alias", "identity"}


def _checked_call(n: fx.Node) -> bool:
    """Whether a dynamo node is a call whose absence from a later graph means the compiler removed
    work of the block: not a projection of a multi-output call (``a, b = x.chunk(2)``), nor a view
    or a call that may be a no-op."""
    if n.op not in ("call_function", "call_method"):
        return False
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if n.target is operator.getitem or name in _NO_OP_NAMES:
        return False
    value = n.meta.get("example_value")
    if any(isinstance(a, fx.Node) and a.meta.get("example_value") is value for a in n.args):
        return False  # returns its input (torch.flatten of what is already flat)
    return not (hasattr(value, "_is_view") and value._is_view())


def compile_facts(gm: fx.GraphModule, cut: Optional[Tuple[Tuple[str, int], ...]] = None) -> CompileFacts:
    """:class:`CompileFacts` of the dynamo graph ``gm``; call it while dynamo calls the backend (a
    recompile passes the ``cut`` read then: the sites recorded since count too). One walk over the
    graph; with no site recorded, none."""
    found = sites()
    calls: Dict[str, set] = {}
    in_subgraph = set()
    places = []
    order: Dict[Tuple[str, int], int] = {}
    members: Dict[str, set] = {}
    for n in gm.graph.nodes if found else ():
        if n.op in ("call_function", "call_method"):
            for site in found:
                position = _source_position(n, site)
                if position is not None:
                    places.append(repr((site.tag, position)))
                    order.setdefault((n.name, id(gm.graph)), len(order))
                    members.setdefault(site.tag, set()).add(n)
                    if _checked_call(n):
                        calls.setdefault(site.tag, set()).add((n.name, id(gm.graph)))
        if n.op == "call_function" and getattr(n.target, "__name__", "") not in _INLINED:
            for arg in n.args:
                sub = getattr(gm, arg.target, None) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None
                if isinstance(sub, fx.GraphModule):
                    in_subgraph.update(site.tag for m in sub.graph.nodes for site in found
                                       if m.op in ("call_function", "call_method") and _source_position(m, site) is not None)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"] if found else []
    index = {n: ("placeholder", i) for i, n in enumerate(holders)}
    reads: Dict[Tuple[str, int], Dict[str, Tuple[Any, ...]]] = {}
    for tag, inside in members.items():
        for n in inside:
            outside = [index.get(a, (a.name, id(gm.graph))) for a in n.all_input_nodes if a not in inside]
            reads.setdefault((n.name, id(gm.graph)), {})[tag] = tuple(dict.fromkeys(outside))
    shapes = tuple(_tensor_kind(n.meta.get("example_value")) for n in holders)
    return CompileFacts(dynamo_cut() if cut is None else cut, {k: frozenset(v) for k, v in calls.items()},
                        frozenset(in_subgraph), tuple(places), order, reads, shapes)


def _tensor_kind(value: Any) -> Any:
    """(dtype, rank) of a tensor, else None: what tells one graph's placeholders from another's."""
    import torch

    return (value.dtype, value.dim()) if isinstance(value, torch.Tensor) else None


def dynamo_cut() -> Tuple[Tuple[str, int], ...]:
    """Where the graph dynamo is handing to its backend ends, as (file, line) of each frame it is
    tracing, innermost first; () at a return, or outside dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not under dynamo, or a torch without it
        return ()
    instruction = getattr(tx, "current_instruction", None)
    if tx is None or (instruction is not None and instruction.opname.startswith("RETURN")):
        return ()
    frames = []
    while tx is not None:
        frames.append((tx.f_code.co_filename, tx.lineno))
        tx = getattr(tx, "parent", None)
    return tuple(frames)


@contextlib.contextmanager
def compiling(facts: Optional[CompileFacts]):
    """Compile graphs knowing :func:`compile_facts` of the dynamo graph they come from."""
    token = _COMPILE.set(facts)
    try:
        yield
    finally:
        _COMPILE.reset(token)


def unfinished(site: RegionSite, nodes: List[fx.Node], graph: fx.Graph, present: Dict[str, set]) -> Optional[str]:
    """Why these nodes, found by stack traces in a graph a backend compiles, may be part of a run
    and not all of it, or None. An op call in place of part of a run computes the whole block from
    it, a wrong result: where dynamo breaks the graph inside the block, a run is split in two; a
    block holding a torch.cond or nested_compile_region leaves pieces in subgraphs, which inductor
    hands over as graphs of their own; and a compiler may have removed a call of the block before
    fxkern's pass (folded as a constant, dead code under torch.func.grad) (found by a review)."""
    facts = _COMPILE.get()
    line = split_run(site, nodes, facts.cut if facts is not None else ())
    if line is not None:
        return (f"torch.compile breaks the graph inside the region (line {line}), so this graph holds only part "
                f"of the block: move what breaks it (print, .item(), a data-dependent branch; "
                f"TORCH_LOGS=graph_breaks names it) out of the block")
    if facts is None:
        return None
    if site.tag in facts.in_subgraph:
        return ("the block holds a higher-order op's subgraph (a torch.cond branch, a nested_compile_region), "
                "whose graphs hold pieces of a run: keep such calls out of the block")
    calls = facts.calls.get(site.tag, frozenset())
    if "calls" not in present:  # once a graph: a model's layers are many instances
        present["calls"] = {_origin(n) for n in graph.nodes if n.op == "call_function"}  # a folded constant is a get_attr
    gone = sorted(name for name, graph_id in calls if (name, graph_id) not in present["calls"])
    if gone:
        return (f"the compiler removed part of the block before fxkern's pass ({', '.join(gone)}: folded as a "
                f"constant, or dead code), so no run of it is whole here")
    made = next((n for n in interface(nodes)[0] if _origin(n) in calls), None)
    if made is not None:
        return (f"the region's input {made.name!r} was made by a call of the block (a compiler folded it into a "
                f"constant), so no run of it is whole here")
    return None


def split_run(site: RegionSite, nodes: List[fx.Node], cut: Tuple[Tuple[str, int], ...]) -> Optional[int]:
    """The line of a graph break inside the site's block that splits these nodes' run between two
    graphs (dynamo ends one graph there and resumes in the next), or None. Such a piece is no run of
    the block: an op call in its place computed the whole block from half of it (found by a probe)."""
    for filename, line in cut:
        if filename == site.filename and site.first < line <= site.last:
            return line
    for n in nodes:
        for filename, line in _RESUMED.findall(n.meta.get("stack_trace") or ""):
            if filename == site.filename and site.first < int(line) <= site.last:
                return int(line)
    return None


def _backward(node: fx.Node) -> bool:
    """Whether aot_autograd made ``node`` for a backward graph. Such nodes carry the stack trace of
    the forward op they differentiate, so a gradient computed there would read as a run of the
    block: an op call in its place gave wrong gradients (found by a probe)."""
    return node.meta.get("partitioner_tag") == "is_backward" or "autograd_backward" in node.meta


def find(graph: fx.Graph) -> List[Tuple[RegionSite, List[fx.Node], bool]]:
    """Each region instance in ``graph``: its site, its nodes in graph order, and whether they are
    exactly one run of the block (tagged while non-strict export traced it).

    Without tags, a site's nodes split into instances by the module that runs
    the block (one instance per layer) and by data flow between the block's
    top-level statements: a value flowing from a later statement to an earlier
    one crosses from one run of the block to the next (a loop, or a helper
    called twice in a row). Pieces of one run that share no data (statements
    of no common operand) are put back together in graph order.
    """
    found = []
    tagged: Dict[str, List[fx.Node]] = {}
    for n in graph.nodes:
        tag = (n.meta.get("custom") or {}).get(TAG) if n.op == "call_function" and not _backward(n) else None
        if isinstance(tag, str):
            tagged.setdefault(tag, []).append(n)
    known = sites()
    for site in known + _saved_sites(tagged, known):
        prefix = f"{site.tag}#"
        runs = [nodes for tag, nodes in tagged.items() if tag.startswith(prefix)]
        if runs:
            found.extend((site, nodes, True) for nodes in runs)
            continue
        if site not in known:
            continue
        stmts: Dict[fx.Node, int] = {}
        for n in graph.nodes:
            if n.op == "call_function" and not _backward(n):
                line = _line_in_site(n, site)
                if line is not None:
                    stmts[n] = site.statement(line)
        if not stmts:
            continue
        paths = {n: tuple((n.meta.get("nn_module_stack") or {}).keys()) for n in stmts}
        owner_depth = min(len(p) for p in paths.values())  # calls into submodules stay in the region
        groups: Dict[Any, List[fx.Node]] = {}
        for n in stmts:
            groups.setdefault(paths[n][:owner_depth], []).append(n)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for members in groups.values():
            found.extend((site, run, False) for run in _runs(_components(members, stmts), stmts, order))
    return found


def _saved_sites(tagged: Dict[str, List[fx.Node]], known: List[RegionSite]) -> List[RegionSite]:
    """The sites of tags no block in this process recorded: a program saved with its tags and loaded
    in a fresh process (the tags name the file, the line and the op; found by a probe). A tag whose
    op no module here registers is left alone, and said in the log."""
    import torch

    seen = {site.tag for site in known}
    found: Dict[str, RegionSite] = {}
    for tag in tagged:
        site_tag = tag.rsplit("#", 1)[0]
        if site_tag in seen or site_tag in found:
            continue
        parts = site_tag.rsplit(":", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        filename, line, op_name = parts
        names = op_name.split(".")
        op = getattr(getattr(torch.ops, names[0], None), names[1], None) if len(names) >= 2 else None
        if op is not None and len(names) > 2:
            op = getattr(op, names[2], None)
        if op is None:
            log.info("fxkern: the program holds a region of %s:%s for %s, which no module imported here registers",
                     filename, line, op_name)
            continue
        found[site_tag] = RegionSite(filename, int(line), int(line), op)
    return list(found.values())


def shares_its_line(site: RegionSite) -> bool:
    """Whether another site is the same ``with`` line with another target: stack traces cannot tell
    their nodes apart (the line took the first target it ran with; found by a review)."""
    return any(other is not site and (other.filename, other.first) == (site.filename, site.first) for other in sites())


def _runs(comps: List[List[fx.Node]], stmts: Dict[fx.Node, int], order: Dict[fx.Node, int]) -> List[List[fx.Node]]:
    """Connected pieces joined into runs of the block, in graph order: a piece joins the run before it
    while their statements differ (two statements sharing no data are one run in two pieces, which
    would each be taken for the whole block); one repeating a statement starts a new run."""
    runs: List[Tuple[set, List[fx.Node]]] = []
    for comp in sorted(comps, key=lambda c: order[c[0]]):
        covered = {stmts[n] for n in comp}
        if runs and not (runs[-1][0] & covered):
            runs[-1][0].update(covered)
            runs[-1][1].extend(comp)
        else:
            runs.append((covered, list(comp)))
    return [sorted(nodes, key=order.__getitem__) for _, nodes in runs]


_FILE_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in ')
_MARKER = re.compile(r'^\s*[~^][~^ ]*$')


def _source_position(node: fx.Node, site: RegionSite) -> Optional[Tuple[Tuple[str, int, Optional[str]], ...]]:
    """Where ``node``'s call is written: the innermost frame of its stack trace inside the site and
    every frame below it (a helper the block calls), each (file, line, marker). The marker is the
    ``^^^`` line Python 3.11+ prints under the call: dynamo's runs from where the call starts to the
    line's end, so it gives the starting column; None where there is none (Python 3.10, torch
    2.11's dynamo, or a call starting where its line does)."""
    frames = _frames(node.meta.get("stack_trace") or "")
    inside = [i for i, (f, line, _) in enumerate(frames) if f == site.filename and site.first < line <= site.last]
    return frames[inside[-1]:] if inside else None


@functools.lru_cache(maxsize=4096)
def _frames(trace: str) -> Tuple[Tuple[str, int, Optional[str]], ...]:
    """(file, line, marker) of each frame of a stack trace (a model's nodes share a few traces)."""
    frames: List[List[Any]] = []
    for text in trace.splitlines():
        found = _FILE_LINE.match(text)
        if found:
            frames.append([found.group(1), int(found.group(2)), None])
        elif frames and _MARKER.match(text) and ("^" in text or "~" in text):
            frames[-1][2] = text.rstrip()
    return tuple(tuple(f) for f in frames)


def _origin(node: fx.Node) -> Any:
    """The traced call ``node`` came from: the first graph's node in its ``from_node`` history (the
    dynamo node of a call that aot_autograd or inductor decomposed into several), else itself."""
    sources = node.meta.get("from_node")
    src = None
    while sources:
        src = sources[-1]
        sources = getattr(src, "from_node", None)
    return (getattr(src, "name", None), getattr(src, "graph_id", None)) if src is not None else node


def columns_known(node: fx.Node, site: RegionSite) -> bool:
    """Whether ``node``'s stack trace marks where on its line the call is (Python 3.11+ under
    torch 2.13; torch 2.11's dynamo traces have lines only)."""
    position = _source_position(node, site)
    return bool(position) and position[0][2] is not None


def repeated_run(nodes: List[fx.Node], site: RegionSite) -> Optional[fx.Node]:
    """A node showing that one instance may hold two runs of the block, or None: two traced calls of
    one op written at one place in the source, as a loop around the block leaves them. Such an
    instance is refused: merging two runs into one op call would change the result. Nodes one call
    decomposed into (inductor's tanh GELU is ten) are one call. The place is the line and the column
    where the call starts (dynamo's markers run from there to the line's end, so ``torch.exp(x) + b``
    starts both calls at one column: the op tells them apart; found by a review). Where the stack
    traces carry no column, two calls of one op on one line read as a repeat too (CLIP's
    ``h * torch.sigmoid(1.702 * h)`` under torch 2.11): rules that told them from a loop by the ops'
    counts merged loops whose runs a compiler had hoisted from or pruned, a wrong result (found by
    two reviews)."""
    seen: Dict[Any, Any] = {}
    for n in nodes:
        if n.target is operator.getitem:  # a projection of a multi-output call, which is itself checked
            continue
        key = (_source_position(n, site), n.target)
        if seen.setdefault(key, _origin(n)) != _origin(n):
            return n
    return None


def _components(nodes: List[fx.Node], stmts: Dict[fx.Node, int]) -> List[List[fx.Node]]:
    parent = {n: n for n in nodes}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in parent and stmts[a] <= stmts[n]:
                parent[root(a)] = root(n)
    comps: Dict[fx.Node, List[fx.Node]] = {}
    for n in nodes:
        comps.setdefault(root(n), []).append(n)
    return list(comps.values())


def interface(nodes: List[fx.Node]) -> Tuple[List[fx.Node], List[fx.Node]]:
    """(inputs in order of first use, outputs in graph order) of a region's nodes."""
    inside = set(nodes)
    inputs: List[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users if not _inert(u))]
    return inputs, outputs


def in_call_order(site: RegionSite, nodes: List[fx.Node], inputs: List[fx.Node]) -> Tuple[List[fx.Node], bool]:
    """``inputs`` (in order of first use) in the order torch.export's graph reads them, and whether that
    order was read from dynamo's graph, where this graph comes from one: each input is found there (a
    call's result by ``from_node``, a placeholder by its place), and ordered by the first of the block's
    calls that reads it, then by its place among that call's arguments: the order Python ran them in,
    as in torch.export's graph. The compiled graph's own order is not it: inductor moves calls
    (``softmax(q @ k.mT) @ v`` read q first there, k in the exported program), aot_autograd drops no-op
    casts (``x.float()`` of a float32 x) and decomposes calls (``linear(x, W, B)`` into ``t(W)``,
    ``addmm(B, x, ...)``): the op got its arguments in another order (found by a probe and a review).
    Where an input is not found, the graph's order, by the dynamo call that first reads each input."""
    facts = _COMPILE.get()
    if facts is None or not facts.order or len(inputs) < 2:
        return inputs, False
    graph = nodes[0].graph
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    same_holders = len(holders) == len(facts.placeholders) and all(
        _tensor_kind(h.meta.get("val")) == kind for h, kind in zip(holders, facts.placeholders))
    keys = {a: (("placeholder", holders.index(a)) if a.op == "placeholder" and same_holders else _origin(a)) for a in inputs}
    first: Dict[fx.Node, Tuple[int, int]] = {}
    if len(set(keys.values())) < len(inputs):  # two inputs from one dynamo value (the halves of a chunk): unknown
        keys = {}
    for call, tags in facts.reads.items():
        read = tags.get(site.tag, ())
        for a in keys:
            if keys[a] in read:
                place = (facts.order[call], read.index(keys[a]))
                if a not in first or place < first[a]:
                    first[a] = place
    if len(first) == len(inputs):
        return sorted(inputs, key=first.__getitem__), True
    by_call = {a: facts.order.get(_origin(n)) for a, n in _first_readers(nodes, inputs).items()}
    if any(place is None for place in by_call.values()):
        return inputs, False  # a call dynamo's graph does not show: the graph's own order
    return sorted(inputs, key=lambda a: by_call[a]), False  # stable: one call's inputs keep their order


def _first_readers(nodes: List[fx.Node], inputs: List[fx.Node]) -> Dict[fx.Node, fx.Node]:
    """Each input's first reader among ``nodes``, in the order the inputs are first read."""
    wanted, first = set(inputs), {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in wanted and a not in first:
                first[a] = n
    return first


def unordered_inputs(nodes: List[fx.Node], inputs: List[fx.Node]) -> Optional[Tuple[List[fx.Node], List[fx.Node]]]:
    """Inputs whose order this graph cannot tell, with the nodes of the call that first reads them;
    None when it can. Inputs map to the op's arguments in order of first use in torch.export's graph,
    where each call is one node whose arguments are in the order written. A graph that decomposed a
    call into several (``from_node``: aot_autograd, inductor, ``run_decompositions``) keeps the calls'
    order but not the order within one: ``linear(x, W, B)`` became ``t(W)``, ``addmm(B, x, ...)``, and
    the op got (W, B, x), a wrong result (found by a probe). Two inputs first read by such a call are
    refused."""
    origin = {n: _origin(n) for n in nodes}
    calls: Dict[Any, List[fx.Node]] = {}
    for n in nodes:
        if n.target is not operator.getitem:  # a projection of a multi-output op is that op (native_layer_norm)
            calls.setdefault(origin[n], []).append(n)
    first: Dict[Any, List[fx.Node]] = {}
    for a, n in _first_readers(nodes, inputs).items():
        first.setdefault(origin[n], []).append(a)
    for call, read in first.items():
        if len(read) > 1 and len(calls.get(call, ())) > 1:
            return read, calls[call]
    return None


def _inert(node: fx.Node) -> bool:
    from fxkern.patterns import is_inert

    return is_inert(node)
