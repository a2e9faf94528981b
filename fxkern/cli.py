"""``python -m fxkern``: the command line (``demo``, ``explain``).

The one place in fxkern that prints: library code logs through
``logging.getLogger("fxkern")``. Every failure the user can fix ends in one
line on stderr saying what to change, and a non-zero exit status: 2 for a
usage problem (a missing file, a bad ``--rules``), 1 when the demo's outputs
disagree with the original model's.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from fxkern.errors import FxkernError

USAGE_ERROR = 2


class CliError(FxkernError, ValueError):
    """A command-line argument names something that cannot be used (file, module, attribute)."""


def load_rules(ref: str | None, default: str = "library") -> Any:
    """The RuleSet that ``--rules MODULE:ATTR`` names (a RuleSet, or a zero-argument callable
    returning one); without ``ref``, the default: ``"library"`` is ``fxkern.library.rules()``,
    ``"library+default"`` adds the rules in ``fxkern.default_rules()`` after it."""
    from fxkern.rules import RuleSet, default_rules

    if ref is None:
        lib = _library_rules()
        if default == "library":
            return lib
        combined = RuleSet(f"{lib.name}+{default_rules().name}")
        for r in list(lib) + list(default_rules()):
            if r.name not in combined:
                combined.add(r)
            elif combined[r.name] is not r:
                print(f"note: the default rule set's {r.name!r} is shadowed by {lib.name}'s rule of that name",
                      file=sys.stderr)
        return combined
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"--rules {ref!r}: expected MODULE:ATTR, e.g. 'fxkern.library:rules' or 'mypkg.kernels:RULES'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"--rules {ref!r}: cannot import module {module_name!r} ({exc}); "
                       f"is it installed, or on PYTHONPATH?") from None
    except Exception as exc:  # noqa: BLE001  (the module's own code failed: a SyntaxError, a bad import time call)
        raise CliError(f"--rules {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    obj: Any = module
    where = f"module {module_name!r}"
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"--rules {ref!r}: {where} has no attribute {part!r}")
        obj = getattr(obj, part)
        where = f"{where}'s {part} ({type(obj).__name__})"
    if not isinstance(obj, RuleSet) and callable(obj):
        try:
            obj = obj()
        except TypeError as exc:
            raise CliError(f"--rules {ref!r}: calling it without arguments failed ({exc}); "
                           f"name a RuleSet or a zero-argument function returning one") from None
        except Exception as exc:  # noqa: BLE001  (the user's function failed)
            raise CliError(f"--rules {ref!r}: calling it raised {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, RuleSet):
        raise CliError(f"--rules {ref!r} is a {type(obj).__name__}, not a fxkern.RuleSet "
                       f"(nor a zero-argument callable returning one)")
    return obj


def _library_rules() -> Any:
    try:
        from fxkern import library
    except ImportError as exc:
        raise CliError(f"fxkern.library cannot be imported ({exc}); pass --rules MODULE:ATTR") from None
    if not callable(getattr(library, "rules", None)):
        raise CliError("fxkern.library has no rules() function (an incomplete install?); pass --rules MODULE:ATTR")
    return library.rules()


# ---- explain --------------------------------------------------------------------------------


def _explain(args: argparse.Namespace) -> int:
    import fxkern

    path = args.file
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    if os.path.isdir(path):
        raise CliError(f"{path}: is a directory, not a .pt2 file saved with torch.export.save")
    for name in args.imports:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (not found, or the module's own code failed)
            raise CliError(f"--import {name!r}: {type(exc).__name__}: {exc}") from None
    rules = load_rules(args.rules, default="library+default")
    ep = load_program(path)
    report = fxkern.explain(ep, rules)
    n_nodes = sum(1 for _ in ep.graph.nodes)
    print(f"{path}: {n_nodes} nodes; rule set {rules.name!r} ({len(rules)} rules)")
    print(report)
    print(f"{len(report.matches)} replaceable, {len(report.near_misses)} near-misses")
    return 0


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.messages.append(text)


def load_program(path: str, library_loaded: bool = False) -> Any:
    """``torch.export.load(path)``, with torch's deserialization warnings turned into one clear error.
    A program calling fxkern's library ops loads once the library has registered them: importing
    ``fxkern.library`` registers nothing, and ``--import fxkern.library`` failed (found by a probe)."""
    import torch

    torch_log = logging.getLogger("torch.export")
    capture, handlers, propagate = _Capture(), torch_log.handlers, torch_log.propagate
    torch_log.handlers, torch_log.propagate = [capture], False  # its traceback dump becomes our one line
    try:
        return torch.export.load(path)
    except Exception as exc:  # noqa: BLE001  (torch raises many kinds; all mean "cannot load")
        logged = "\n".join(capture.messages)
        unresolved = re.search(r"failed to resolve (torch\.ops\.[\w.]+?)(?:\.default)? to an operator", logged)
        if unresolved and unresolved.group(1).startswith("torch.ops.fxkern_lib.") and not library_loaded:
            _library_rules()  # registers the library's ops
            torch_log.handlers, torch_log.propagate = handlers, propagate
            return load_program(path, library_loaded=True)
        if unresolved:
            raise CliError(f"{path} calls {unresolved.group(1)}, which no module imported here registers; "
                           f"pass --import MODULE for the module that defines it") from None
        # a model's output class (transformers' CausalLMOutputWithPast) is registered with pytree
        # where it is defined: importing that module is what loading needs
        unregistered = re.search(r"Deserializing ([\w.]+)\.(\w+) in pytree is not registered", logged + str(exc))
        if unregistered:
            raise CliError(f"{path} returns {unregistered.group(1)}.{unregistered.group(2)}, a type registered with "
                           f"pytree where it is defined: pass --import {unregistered.group(1)}") from None
        # torch's own exception says "see the warnings above"; the cause is the logged traceback's last line
        causes = [ln for ln in logged.splitlines() if re.match(r"[\w.]+(Error|Exception): ", ln)]  # dotted too:
        # torch._export.serde.serialize.SerializeError: Serialized schema version ... does not match ...
        cause = causes[-1] if causes else f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        raise CliError(f"{path}: cannot load it as an ExportedProgram saved by torch.export.save ({cause})") from None
    finally:
        torch_log.handlers, torch_log.propagate = handlers, propagate


# ---- the parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from fxkern import demo

    parser = argparse.ArgumentParser(
        prog="python -m fxkern",
        description="fxkern: hand-written CUDA kernels as torch ops, in exported and compiled models.",
    )
    parser.add_argument("--log", choices=["debug", "info", "warning"], default=None,
                        help="print fxkern's log records at this level on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "demo", help="the kernel library on a small Llama-style model: export, rewrite, verify, time",
        description=demo.DESCRIPTION)
    demo.add_arguments(d)
    e = sub.add_parser(
        "explain", help="what the rules would replace in a saved ExportedProgram, and why not elsewhere",
        description=("Load a program saved with torch.export.save and print fxkern.explain's report. "
                     "Default rules: fxkern.library.rules(), then the default rule set (which modules "
                     "passed with --import fill by calling fxkern.replace)."))
    e.add_argument("file", metavar="FILE.pt2", help="a program saved with torch.export.save")
    e.add_argument("--rules", metavar="MODULE:ATTR", default=None,
                   help="a RuleSet, or a zero-argument callable returning one (default: the library's, then the default set)")
    e.add_argument("--import", dest="imports", metavar="MODULE", action="append", default=[],
                   help="import MODULE first (registers its ops and rules); repeatable")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m fxkern`` and the ``fxkern`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if os.getcwd() not in sys.path and "" not in sys.path:
        # the installed script's sys.path starts at its own directory; `python -m fxkern` puts the working
        # directory first, and --rules/--import name modules from it (found by a review)
        sys.path.insert(0, os.getcwd())
    if args.log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger("fxkern").addHandler(handler)
        logging.getLogger("fxkern").setLevel(args.log.upper())
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    try:
        with warnings.catch_warnings():
            # torch 2.13 warns about its own pytree internals while fxkern traces patterns: noise here
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
            if args.command == "demo":
                from fxkern import demo

                return demo.run(args)
            return _explain(args)
    except CliError as exc:
        print(f"fxkern {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except FxkernError as exc:
        print(f"fxkern {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
