"""One expression language for sizes, extras and launch geometry.

A spec's output shapes, extras and grid are written once, as small
expression trees over the shapes of the call's tensors. Interpreters give
them meaning:

* :data:`PYTHON` evaluates with Python operators, so the same code serves
  concrete ints (eager launch) and torch SymInts (fake/meta under dynamic
  shapes);
* :mod:`fxkern.tensorrt.plugin` supplies an :class:`Arithmetic` over
  TensorRT's symbolic shape expressions (AOT plugin).

Expressions are compiled once to closures (:func:`compile_expr`), so the
eager hot path does no tree walking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Tuple, Union

# An environment: (input shapes, output shapes), each a sequence of sequences of dims.
Env = Tuple[Sequence[Sequence[Any]], Sequence[Sequence[Any]]]

INPUT, OUTPUT = "input", "output"


class Expr:
    """Base of integer expressions. ``+``, ``*``, ``//`` and :func:`cdiv` build trees."""

    def __add__(self, other: Any) -> "Expr":
        return BinOp("add", self, lift(other))

    def __radd__(self, other: Any) -> "Expr":
        return BinOp("add", lift(other), self)

    def __mul__(self, other: Any) -> "Expr":
        return BinOp("mul", self, lift(other))

    def __rmul__(self, other: Any) -> "Expr":
        return BinOp("mul", lift(other), self)

    def __floordiv__(self, other: Any) -> "Expr":
        return BinOp("floordiv", self, lift(other))

    def __rfloordiv__(self, other: Any) -> "Expr":
        return BinOp("floordiv", lift(other), self)

    def __bool__(self) -> bool:
        raise TypeError(
            "a symbolic size has no truth value: it is only known per call. "
            "Write the geometry without branching on sizes."
        )


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: int


@dataclass(frozen=True, eq=True)
class Dim(Expr):
    """Dimension ``axis`` (negative allowed) of tensor ``index`` of ``kind`` (input or output)."""

    kind: str
    index: int
    axis: int


@dataclass(frozen=True, eq=True)
class Prod(Expr):
    """Product of the dimensions of a tensor, leaving out ``skip`` axes (numel when empty)."""

    kind: str
    index: int
    skip: Tuple[int, ...] = ()


@dataclass(frozen=True, eq=True)
class BinOp(Expr):
    op: str  # add, mul, floordiv, cdiv
    lhs: Expr
    rhs: Expr


def lift(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Const(value)
    raise TypeError(
        f"expected an int or a symbolic size expression, got {type(value).__name__} {value!r}"
    )


def cdiv(a: Any, b: Any) -> Expr:
    """Ceiling division, ``(a + b - 1) // b`` for positive ``b``."""
    return BinOp("cdiv", lift(a), lift(b))


class Shape:
    """A tensor's shape as symbols, handed to ``Custom`` geometry functions."""

    def __init__(self, kind: str, index: int):
        self.kind, self.index = kind, index

    def __getitem__(self, axis: int) -> Dim:
        if not isinstance(axis, int):
            raise TypeError("index a symbolic shape with an int axis (negative allowed)")
        return Dim(self.kind, self.index, axis)

    def numel(self, skip: Tuple[int, ...] = ()) -> Prod:
        return Prod(self.kind, self.index, tuple(skip))


# ---- shapes of outputs ------------------------------------------------------


@dataclass(frozen=True)
class ShapeOf:
    """The whole shape of tensor input ``index``."""

    index: int


@dataclass(frozen=True)
class Reduced:
    """Tensor input ``index``'s shape with ``dims`` removed (or kept as 1)."""

    index: int
    dims: Tuple[int, ...]
    keepdim: bool


@dataclass(frozen=True)
class Dims:
    """A shape given dimension by dimension (read off a ``meta_fn`` run on symbolic sizes)."""

    dims: Tuple[Expr, ...]


ShapeExpr = Union[ShapeOf, Reduced, Dims]

# ---- interpreters ------------------------------------------------------------


class Arithmetic:
    """What an interpreter must provide. The base class is Python's own arithmetic."""

    def const(self, value: int) -> Any:
        return value

    def add(self, a: Any, b: Any) -> Any:
        return a + b

    def mul(self, a: Any, b: Any) -> Any:
        return a * b

    def floordiv(self, a: Any, b: Any) -> Any:
        return a // b

    def cdiv(self, a: Any, b: Any) -> Any:
        return (a + b - 1) // b


PYTHON = Arithmetic()


def normalize_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise IndexError(f"axis {axis} is out of range for {what} of rank {ndim}")
    return axis % ndim


def compile_expr(expr: Expr, arith: Arithmetic = PYTHON) -> Callable[[Env], Any]:
    """Turn an expression into a closure ``env -> value`` under ``arith``.

    Under Python arithmetic (eager launches run this per call) the closures
    are specialised: a numel is ``math.prod`` over the shape, an operation
    with a constant operand folds the constant in.
    """
    if isinstance(expr, Const):
        value = expr.value
        if arith is PYTHON:
            return lambda env: value
        return lambda env: arith.const(value)
    if isinstance(expr, Dim):
        side, index, axis = (0 if expr.kind == INPUT else 1), expr.index, expr.axis
        what = f"{expr.kind} {index}"

        def dim(env: Env) -> Any:
            shape = env[side][index]
            try:
                return shape[axis]
            except IndexError:
                raise IndexError(f"axis {axis} is out of range for {what} of rank {len(shape)}") from None

        return dim
    if isinstance(expr, Prod):
        side, index, skip = (0 if expr.kind == INPUT else 1), expr.index, expr.skip
        if not skip and arith is PYTHON:
            return lambda env: math.prod(env[side][index])
        what = f"{expr.kind} {index}"

        def prod(env: Env) -> Any:
            shape = env[side][index]
            skipped = {normalize_axis(a, len(shape), what) for a in skip}
            result = None
            for i, d in enumerate(shape):
                if i not in skipped:
                    result = d if result is None else arith.mul(result, d)
            return arith.const(1) if result is None else result

        return prod
    if isinstance(expr, BinOp):
        lhs = compile_expr(expr.lhs, arith)
        if arith is PYTHON and isinstance(expr.rhs, Const):
            c = expr.rhs.value
            folded = {
                "add": lambda env: lhs(env) + c,
                "mul": lambda env: lhs(env) * c,
                "floordiv": lambda env: lhs(env) // c,
                "cdiv": lambda env: (lhs(env) + (c - 1)) // c,
            }
            return folded[expr.op]
        rhs = compile_expr(expr.rhs, arith)
        fn = getattr(arith, expr.op)
        return lambda env: fn(lhs(env), rhs(env))
    raise TypeError(f"not a size expression: {expr!r}")


def compile_shape(shape: ShapeExpr, arith: Arithmetic = PYTHON) -> Callable[[Env], list]:
    """Closure ``env -> list of dims`` for an output shape (dims are passed through, never rebuilt)."""
    if isinstance(shape, ShapeOf):
        index = shape.index
        return lambda env: list(env[0][index])
    if isinstance(shape, Reduced):
        index, dims, keepdim = shape.index, shape.dims, shape.keepdim

        def reduced(env: Env) -> list:
            src = env[0][index]
            drop = {normalize_axis(d, len(src), f"input {index}") for d in dims}
            if keepdim:
                return [arith.const(1) if i in drop else d for i, d in enumerate(src)]
            return [d for i, d in enumerate(src) if i not in drop]

        return reduced
    if isinstance(shape, Dims):
        fns = [compile_expr(d, arith) for d in shape.dims]
        return lambda env: [f(env) for f in fns]
    raise TypeError(f"not a shape expression: {shape!r}")
