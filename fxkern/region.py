"""``with fxkern.region(target):`` marks a block of model code as one replaceable region.

The mark is the block's place in the source: entering the context records
the file and the line span of the ``with`` statement (read with ``ast``).
torch.export and dynamo keep each node's ``stack_trace``, so the nodes
traced inside the block are found again in any exported or compiled graph
without the user doing anything else. Under dynamo the context is skipped
(frame inspection cannot be traced): the site is the one recorded when the
block last ran outside the compiler, in eager or under torch.export. At run
time the context does nothing.

``apply`` replaces every region it finds, whatever rule set it is given: the
region's inputs (values made outside and used inside, in order of first use)
and outputs (values made inside and used after it, in graph order) map to
the op's tensor arguments and returns by position.
"""

from __future__ import annotations

import ast
import linecache
import logging
import re
import sys
from dataclasses import dataclass
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

    @property
    def label(self) -> str:
        return f"region@{self.filename.rsplit('/', 1)[-1]}:{self.first}"


_SITES: Dict[Tuple[str, int], RegionSite] = {}


def sites() -> List[RegionSite]:
    return list(_SITES.values())


class region:
    """Mark the code inside the ``with`` block as one call of ``target`` (an op, or a KernelSpec
    registered as ``fxkern::<name>``; ``reference`` becomes its CPU impl)."""

    def __init__(self, target: Any, *, name: Optional[str] = None, reference: Any = None):
        self.target, self.name, self.reference = target, name, reference

    def __enter__(self) -> "region":
        import torch

        if torch.compiler.is_dynamo_compiling():  # the site was recorded when the block last ran outside dynamo
            return self
        frame = sys._getframe(1)
        filename, line = frame.f_code.co_filename, frame.f_lineno
        key = (filename, line)
        if key not in _SITES:
            _SITES[key] = RegionSite(filename, line, _block_end(filename, line), self._op(filename, line))
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def _op(self, filename: str, line: int) -> Any:
        if isinstance(self.target, KernelSpec):
            from fxkern.ops import cuda_kernel_op

            name = self.name or f"region_{re.sub(r'[^0-9A-Za-z_]', '_', filename.rsplit('/', 1)[-1])}_{line}"
            return cuda_kernel_op(name if "::" in name else f"fxkern::{name}", self.target, reference=self.reference)
        return self.target


def _block_end(filename: str, line: int) -> int:
    """Last line of the ``with`` statement that starts at ``line``."""
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise SpecError(f"fxkern.region at {filename}:{line}: cannot read the source ({exc})") from exc
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno <= line < node.body[0].lineno:
            return node.end_lineno
    raise SpecError(f"fxkern.region at {filename}:{line}: use it as `with fxkern.region(...):`")


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _line_in_site(node: fx.Node, site: RegionSite) -> Optional[int]:
    """The line of the innermost frame of ``node``'s stack trace inside the site, or None."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [int(n) for f, n in _FRAME.findall(trace) if f == site.filename and site.first < int(n) <= site.last]
    return lines[-1] if lines else None


def find(graph: fx.Graph) -> List[Tuple[RegionSite, List[fx.Node]]]:
    """Each region instance in ``graph``: its site and its nodes in graph order.

    A site's nodes split into instances by the module that runs the block
    (one instance per layer) and by data flow that goes forward in the
    block's source: a value flowing from a later line to an earlier one
    crosses from one run of the block to the next (a loop, or a helper
    called twice in a row).
    """
    found = []
    for site in sites():
        lines: Dict[fx.Node, int] = {}
        for n in graph.nodes:
            if n.op == "call_function":
                line = _line_in_site(n, site)
                if line is not None:
                    lines[n] = line
        if not lines:
            continue
        paths = {n: tuple((n.meta.get("nn_module_stack") or {}).keys()) for n in lines}
        owner_depth = min(len(p) for p in paths.values())  # calls into submodules stay in the region
        groups: Dict[Any, List[fx.Node]] = {}
        for n in lines:
            groups.setdefault(paths[n][:owner_depth], []).append(n)
        for members in groups.values():
            found.extend((site, comp) for comp in _components(members, lines))
    return found


def repeated_run(nodes: List[fx.Node], site: RegionSite) -> Optional[fx.Node]:
    """A node showing that one instance holds two runs of the block (the same op on the same
    line twice, as a loop around the block leaves it), or None. Such an instance is refused:
    runs on one line cannot be told apart, and merging them would change the result."""
    seen = set()
    for n in nodes:
        key = (_line_in_site(n, site), n.target)
        if key in seen:
            return n
        seen.add(key)
    return None


def _components(nodes: List[fx.Node], lines: Dict[fx.Node, int]) -> List[List[fx.Node]]:
    parent = {n: n for n in nodes}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in parent and lines[a] <= lines[n]:
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
    outputs = [n for n in nodes if any(u not in inside for u in n.users if not _assertion(u))]
    return inputs, outputs


def _assertion(node: fx.Node) -> bool:
    from fxkern.patterns import is_assertion

    return is_assertion(node)
