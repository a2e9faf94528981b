"""fxkern inside Torch-TensorRT: rules as a lowering pass, ops as AOT plugin layers.

Once fxkern is imported and Torch-TensorRT is importable with its plugin
support on (in either import order), fxkern

* registers a TensorRT plugin and a converter for every fxkern op, present
  and future (:mod:`fxkern.tensorrt.plugin`, :mod:`fxkern.tensorrt.converter`);
* appends an ATen lowering pass that applies the default rule set to the
  graphs Torch-TensorRT lowers, with patterns traced in its IR
  (:mod:`fxkern.tensorrt.decompositions`).

So ``fxkern.replace(...)`` then ``torch_tensorrt.compile(model, ...)`` puts
the kernels in the engine. :func:`enable` picks another rule set,
:func:`disable` turns the automatic rewrite off, :func:`available` says
whether any of this can work here and, if not, why.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

from fxkern.errors import TensorRTUnavailable

log = logging.getLogger("fxkern")

# Releases whose plugin support works, from their pinned TensorRT (docs/tensorrt.md).
WORKING = ("torch-tensorrt 2.12 with TensorRT 10.16, 2.13 with TensorRT 11.0, "
           "2.14 with TensorRT 11.1 (2.11 turns plugins off for TensorRT 10.14/10.15)")
IRS = ("tensorrt", "tensorrt_aot")


@dataclass(frozen=True)
class Availability:
    """Whether Torch-TensorRT plugins are usable here; false with the reason when not."""

    ok: bool
    reason: str
    versions: Dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return "Torch-TensorRT plugins are available" if self.ok else self.reason


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def available() -> Availability:
    """Check Torch-TensorRT, TensorRT, its ``tensorrt.plugin`` module and both plugin gates."""
    versions = {"torch-tensorrt": _version("torch-tensorrt"), "tensorrt": "not installed"}
    if importlib.util.find_spec("torch_tensorrt") is None:
        return Availability(False, "torch_tensorrt is not installed (pip install torch-tensorrt; "
                            f"working versions: {WORKING})", versions)
    try:
        import torch_tensorrt  # first: it sets up the tensorrt module it wants (RTX, capture)
        from torch_tensorrt._features import ENABLED_FEATURES

        import tensorrt

        versions["tensorrt"] = getattr(tensorrt, "__version__", "unknown")
    except Exception as exc:  # a stub package or a broken install
        return Availability(False, f"torch_tensorrt or tensorrt does not import ({type(exc).__name__}: {exc}); "
                            f"working versions: {WORKING}", versions)
    versions["torch-tensorrt"] = getattr(torch_tensorrt, "__version__", versions["torch-tensorrt"])
    if not getattr(ENABLED_FEATURES, "qdp_plugin", False):
        return Availability(False, f"torch-tensorrt {versions['torch-tensorrt']} turns TensorRT plugins off with "
                            f"TensorRT {versions['tensorrt']} (its qdp_plugin feature gate); "
                            f"working versions: {WORKING}", versions)
    if not hasattr(tensorrt, "QuickPluginCreationRequest"):
        return Availability(False, f"TensorRT {versions['tensorrt']} has no ahead-of-time plugin support "
                            f"(tensorrt.QuickPluginCreationRequest); working versions: {WORKING}", versions)
    return Availability(True, "", versions)


@dataclass
class _State:
    enabled: bool = True
    rules: Any = None  # None: the default rule set, read at each compile
    strict_aot: bool = False
    active: bool = False  # plugins, converters and the pass are registered
    registered: set = field(default_factory=set)
    said_unavailable: bool = False
    reports: Any = field(default_factory=lambda: collections.deque(maxlen=64))  # the latest lowering reports


_state = _State()
# Set by fxkern.backend(inner="tensorrt") around its compile: (rules, report callback).
_override: contextvars.ContextVar = contextvars.ContextVar("fxkern_tensorrt_rules", default=None)


def enable(rules: Any = None, *, strict_aot: bool = False) -> None:
    """Apply ``rules`` (default: the default rule set) inside every Torch-TensorRT compile.

    ``strict_aot=True`` makes an op without an AOT implementation an error at
    conversion instead of a JIT plugin (which needs Python at run time).
    """
    _state.enabled, _state.rules, _state.strict_aot = True, rules, strict_aot
    _activate_if_imported()


def disable() -> None:
    """Stop rewriting graphs inside Torch-TensorRT (converters stay: explicit fxkern ops still convert)."""
    _state.enabled = False


@contextlib.contextmanager
def using(rules: Any, report: Optional[Callable[[Any], None]] = None) -> Iterator[None]:
    """Within the block, the lowering pass applies ``rules`` whatever :func:`enable` chose."""
    token = _override.set((rules, report))
    try:
        yield
    finally:
        _override.reset(token)


def lowering_pass(gm: Any, settings: Any = None) -> Any:
    """Torch-TensorRT ATen post-lowering pass ``(gm, settings) -> gm``: apply the rules."""
    from fxkern.rewrite import rewrite_graph
    from fxkern.rules import default_rules

    override = _override.get()
    if override is None and not _state.enabled:
        return gm
    rules, report_cb = override if override is not None else (_state.rules, None)
    report = rewrite_graph(gm.graph, rules if rules is not None else default_rules(), IRS)
    _state.reports.append(report)
    if report_cb is not None:
        report_cb(report)
    if report.matches:
        log.info("fxkern: replaced %d subgraphs inside Torch-TensorRT (%s)", len(report.matches),
                 ", ".join(sorted({m.rule for m in report.matches})))
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return gm


def register_op(entry: Any) -> None:
    """Give one fxkern op a TensorRT plugin and a converter (once per op)."""
    from fxkern.tensorrt import converter, plugin

    if entry.qualname in _state.registered:
        return
    pp = plugin.plan_plugin(entry)
    if pp.why_not:
        log.warning("fxkern: %s gets no TensorRT plugin and runs in PyTorch: %s", entry.qualname, pp.why_not)
        _state.registered.add(entry.qualname)
        return
    if not pp.aot:
        log.warning("fxkern: %s becomes a JIT TensorRT plugin (Python at run time): %s", entry.qualname, pp.why_jit)
    from torch_tensorrt.dynamo.conversion import ConverterPriority, dynamo_tensorrt_converter

    plugin.register(pp, plugin.real_api())
    dynamo_tensorrt_converter(
        entry.op.default,
        capability_validator=converter.make_validator(pp, lambda: _state.strict_aot),
        priority=ConverterPriority.HIGH,
        supports_dynamic_shapes=entry.supports_dynamic_shapes,
    )(converter.make_converter(pp))
    _state.registered.add(entry.qualname)


def _activate() -> None:
    """Register everything with Torch-TensorRT; called once it is imported (whichever came first)."""
    if _state.active:
        return
    status = available()
    if not status:
        if not _state.said_unavailable:
            _state.said_unavailable = True
            log.warning("fxkern: Torch-TensorRT integration is off: %s", status.reason)
        return
    from torch_tensorrt.dynamo.lowering.passes import ATEN_POST_LOWERING_PASSES

    from fxkern import ops

    ATEN_POST_LOWERING_PASSES.add_pass_with_index(lowering_pass, None)
    _state.active = True
    for entry in ops.registered_ops():
        _register_logged(entry)
    ops.on_register(_register_logged)


def _register_logged(entry: Any) -> None:
    try:
        register_op(entry)
    except Exception as exc:  # one bad op must not break the compile of every other
        log.warning("fxkern: could not register %s with TensorRT: %s", entry.qualname, exc)


def _activate_if_imported() -> None:
    if "torch_tensorrt" in sys.modules:
        _activate()


# ---- import-order independence ------------------------------------------------------


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module finishes importing.

    ``find_spec`` only wraps the loader the other finders return (``importlib.util.find_spec``
    probes through here without importing, so nothing is consumed then); the callbacks run, once,
    when the wrapped loader has executed the module.
    """

    def __init__(self) -> None:
        self.callbacks: Dict[str, List[Callable[[], None]]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, name, self)
        return spec

    def run(self, name: str) -> None:
        for cb in self.callbacks.pop(name, []):
            try:
                cb()
            except Exception as exc:  # never break the user's import
                log.warning("fxkern: after importing %s: %s", name, exc)


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, with the callbacks run after ``exec_module``; everything else is
    forwarded (resource readers, ``is_package``...)."""

    def __init__(self, loader: Any, name: str, hook: _AfterImport):
        self._loader, self._name, self._hook = loader, name, hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._hook.run(self._name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


_hook = _AfterImport()


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``module`` is imported, else right after it is."""
    if module in sys.modules:
        callback()
        return
    _hook.callbacks.setdefault(module, []).append(callback)
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def install() -> None:
    """Called by ``import fxkern``: hook into Torch-TensorRT now or when it is imported."""
    after_import("torch_tensorrt", _activate)


def compile_backend() -> Callable[..., Any]:
    """Torch-TensorRT's torch.compile backend, with fxkern registered; a clear error if unusable."""
    status = available()
    if not status:
        raise TensorRTUnavailable(f"fxkern.backend(inner='tensorrt'): {status.reason}")
    import torch_tensorrt  # noqa: F401  (importing registers the "tensorrt" backend and runs _activate)
    from torch._dynamo import lookup_backend

    _activate()
    return lookup_backend("tensorrt")


__all__ = ["Availability", "available", "disable", "enable", "using", "lowering_pass", "register_op"]
