"""A STAND-IN for ``tensorrt.plugin``: NOT TensorRT, and never evidence that TensorRT works.

TensorRT cannot be installed on this project's machines. This module
reproduces the *restrictions* of the ``tensorrt.plugin`` API that fxkern's
plugin code must respect, as documented in
``../shared/reference/torch-tensorrt-plugins.md`` (§2), so that tests fail
where real TensorRT would:

* symbolic integers support ``+ - * // == <`` with the symbolic operand on
  the left only: no reflected operators, no ``/ % -x > <= >= **``;
* no truth value (``bool(expr)`` raises), ``==`` builds an expression;
* ``cdiv``/``max``/``min`` of two plain ints raise;
* constants (``SymInt32(7)``, ``ShapeExpr(7)``) are real only while a build is
  active (:func:`building`); made elsewhere they are fake;
* every value is a 32-bit int: floats are rejected, results past int32 raise;
* an op on a plain ``SymInt32`` returns a plain ``SymIntExpr`` (not a
  ``SymInt32``), so extras must be re-wrapped;
* extra arguments must each be a ``SymInt32``; ``SymIntExprs[i] = 5`` stores a
  plain ``SymIntExpr`` (the documented trap);
* descriptor and ``aot_impl`` signatures are validated by the sheet's rules.

Unlike TensorRT, every expression here carries a concrete value, so a test
can read what the plugin would launch at given input sizes. That is the
"concrete interpreter" the GPU replay test uses.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import operator
import typing
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_building = False


class StandInError(Exception):
    """A use of the plugin API that the fact sheet says TensorRT rejects."""


@contextlib.contextmanager
def building():
    """While TensorRT is building: constants are real expressions."""
    global _building
    old, _building = _building, True
    try:
        yield
    finally:
        _building = old


def _check32(v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise StandInError(f"symbolic expressions hold ints, got {type(v).__name__}")
    if not INT32_MIN <= v <= INT32_MAX:
        raise OverflowError(f"{v} does not fit TensorRT's 32-bit plugin integers")
    return v


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


class SymExpr:
    pass


class SymIntExpr(SymExpr):
    def __init__(self, value: Any = None):
        self._v = None  # None: fake (no builder, or a dummy)
        if isinstance(value, float):
            raise StandInError("Float symbolic expressions are not supported")
        if isinstance(value, int) and not isinstance(value, bool):
            if _building:
                self._v = _check32(value)
        elif isinstance(value, SymIntExpr):
            self._v = value._v
        elif value is not None:
            raise StandInError(f"cannot make a symbolic int from {type(value).__name__}")

    @property
    def value(self) -> int:
        """The concrete value (stand-in only; TensorRT has no such thing at build time)."""
        if self._v is None:
            raise StandInError("read the value of a fake expression (made outside a build, or a dummy)")
        return self._v

    def _wrap(self, v: int) -> "SymIntExpr":
        return SymIntExpr._made(v)

    @classmethod
    def _made(cls, v: int) -> "SymIntExpr":
        out = cls.__new__(cls)
        SymIntExpr.__init__(out)
        out._v = _check32(v)
        if isinstance(out, ShapeExpr):
            out._is_dummy = False
        return out

    def _op(self, fn: Callable[[int, int], int], other: Any) -> "SymIntExpr":
        if isinstance(other, bool) or not isinstance(other, (int, SymIntExpr)):
            raise StandInError(f"operand must be an int or a symbolic int, got {type(other).__name__}")
        if isinstance(other, int):
            other = SymIntExpr(other)
        if self._v is None or other._v is None:
            raise StandInError("arithmetic on a fake expression outside a build")
        return self._wrap(fn(self._v, other._v))

    def __add__(self, o): return self._op(operator.add, o)
    def __sub__(self, o): return self._op(operator.sub, o)
    def __mul__(self, o): return self._op(operator.mul, o)
    def __floordiv__(self, o): return self._op(operator.floordiv, o)
    def __eq__(self, o): return self._op(lambda a, b: int(a == b), o)  # an expression, not a bool
    def __lt__(self, o): return self._op(lambda a, b: int(a < b), o)
    __hash__ = object.__hash__

    def __bool__(self):
        raise StandInError("a symbolic expression has no truth value (TensorRT 10.16+ raises; 10.15 is always True)")

    def __index__(self):
        raise StandInError("a symbolic expression is not a Python int")


class SymInt32(SymIntExpr):
    def __call__(self) -> int:
        return self.value


class ShapeExpr(SymInt32):
    def __init__(self, value: Any = None):
        super().__init__(value)
        self._is_dummy = self._v is None

    @property
    def is_fake(self) -> bool:
        return self._is_dummy

    def _wrap(self, v: int) -> "ShapeExpr":
        return ShapeExpr._made(v)

    def _op(self, fn, other):
        if self._is_dummy:
            return ShapeExpr()
        return super()._op(fn, other)


def _input_dim(v: int) -> ShapeExpr:
    """A dimension of a network input (not a constant: valid outside a build too)."""
    return ShapeExpr._made(v)


def cdiv(a: Any, b: Any) -> ShapeExpr:
    return _top(a, b, lambda x, y: -(-x // y))


def max(a: Any, b: Any) -> ShapeExpr:  # noqa: A001 (the API's name)
    return _top(a, b, lambda x, y: x if x > y else y)


def min(a: Any, b: Any) -> ShapeExpr:  # noqa: A001
    return _top(a, b, lambda x, y: x if x < y else y)


def _top(a: Any, b: Any, fn: Callable[[int, int], int]) -> ShapeExpr:
    if isinstance(a, int):
        if isinstance(b, int):
            raise StandInError("Both arguments cannot be 'int's")
        a = ShapeExpr(a)
    if isinstance(a, ShapeExpr) and a.is_fake:
        return ShapeExpr()
    out = a._op(fn, b)
    return out if isinstance(out, ShapeExpr) else ShapeExpr(out)


class SymExprs:
    def __init__(self, length: int):
        self._exprs: List[Any] = [None] * length

    def __len__(self):
        return len(self._exprs)

    def __iter__(self):
        return iter(self._exprs)

    def __getitem__(self, i):
        return self._exprs[i]

    def __setitem__(self, i, expr):
        if i >= len(self._exprs):
            raise IndexError("Index out of range")
        if not isinstance(expr, SymExpr):
            if isinstance(expr, float):
                raise StandInError("Float symbolic expressions are not supported")
            expr = SymInt32(expr)
        self._exprs[i] = expr


class SymIntExprs(SymExprs):
    def __setitem__(self, i, value):
        if not isinstance(value, SymIntExpr):
            if not isinstance(value, int):
                raise StandInError(f"Value should be int or SymIntExpr. Got '{type(value)}'")
            value = SymIntExpr(value)  # the trap: a plain SymIntExpr, later rejected as an extra
        self._exprs[i] = value


class ShapeExprs(SymExprs):
    def __init__(self, length: int, _is_dummy: bool = False):
        if length > 8:
            raise StandInError(f"ShapeExprs can only support up to 8 dimensions. {length} given.")
        super().__init__(length)
        if _is_dummy:
            self._exprs = [ShapeExpr() for _ in range(length)]

    @classmethod
    def from_tuple(cls, exprs: Sequence[Any]) -> "ShapeExprs":
        out = cls(len(exprs))
        out._exprs = [e if isinstance(e, ShapeExpr) else ShapeExpr(e) for e in exprs]
        return out

    def __setitem__(self, i, value):
        if not isinstance(value, ShapeExpr):
            if not isinstance(value, int):
                raise StandInError(f"Value should be int or ShapeExpr. Got '{type(value)}'")
            value = ShapeExpr(value)
        self._exprs[i] = value

    def numel(self) -> ShapeExpr:
        out = ShapeExpr(1)
        for e in self._exprs:
            out = out * e
        return out


class TensorDesc:
    def __init__(self, dtype: DataType, shape_expr: ShapeExprs):
        self.dtype, self.shape_expr = dtype, shape_expr

    @property
    def ndim(self) -> int:
        return len(self.shape_expr)

    def like(self) -> "TensorDesc":
        return TensorDesc(self.dtype, ShapeExprs.from_tuple(list(self.shape_expr)))


class Tensor:
    """Annotation type of JIT-implementation arguments."""


def from_shape_expr(shape_expr: Any, dtype: DataType) -> TensorDesc:
    if isinstance(shape_expr, tuple):
        shape_expr = ShapeExprs.from_tuple(shape_expr)
    if not isinstance(shape_expr, ShapeExprs):
        raise StandInError(f"from_shape_expr takes a tuple or ShapeExprs, got {type(shape_expr).__name__}")
    if not isinstance(dtype, DataType):
        raise StandInError(f"dtype must be a DataType, got {dtype!r}")
    return TensorDesc(dtype, shape_expr)


_FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")


class KernelLaunchParams:
    def __init__(self, grid_x=1, grid_y=1, grid_z=1, block_x=1, block_y=1, block_z=1, shared_mem=0):
        for name, v in zip(_FIELDS, (grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem)):
            setattr(self, name, v)

    def __setattr__(self, name, value):
        if name not in _FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        if isinstance(value, float):
            raise StandInError(f"{name}: Float symbolic expressions are not supported")
        self.__dict__[name] = SymInt32(value)


# ---- the API object fxkern's plugin code takes ---------------------------------------


class _PluginModule:
    """What fxkern.tensorrt.plugin.Api(plugin=...) expects, from this stand-in."""

    TensorDesc, Tensor, ShapeExpr, ShapeExprs = TensorDesc, Tensor, ShapeExpr, ShapeExprs
    SymIntExpr, SymInt32, SymExprs, SymIntExprs = SymIntExpr, SymInt32, SymExprs, SymIntExprs
    KernelLaunchParams = KernelLaunchParams
    cdiv, max, min, from_shape_expr = staticmethod(cdiv), staticmethod(max), staticmethod(min), \
        staticmethod(from_shape_expr)


plugin = _PluginModule()
TORCH_TO_TRT = {torch.float32: DataType.FLOAT, torch.float16: DataType.HALF, torch.bfloat16: DataType.BF16,
                torch.int32: DataType.INT32, torch.int64: DataType.INT64, torch.int8: DataType.INT8,
                torch.uint8: DataType.UINT8, torch.bool: DataType.BOOL}


def desc(t: torch.Tensor, fake: bool = False) -> TensorDesc:
    """An input descriptor for tensor ``t`` (fake: only the dtype is known, as in the dtype pass)."""
    if fake:
        return TensorDesc(TORCH_TO_TRT[t.dtype], ShapeExprs(t.dim(), _is_dummy=True))
    return TensorDesc(TORCH_TO_TRT[t.dtype], ShapeExprs.from_tuple([_input_dim(int(d)) for d in t.shape]))


# ---- the fact sheet's signature rules ------------------------------------------------------

FORBIDDEN_ATTRS = {"outputs", "stream", "tactic"}
ATTR_TYPES = (int, float, str, bool, bytes)


def check_register(fn: Callable) -> Tuple[List[str], Dict[str, type], int]:
    """§2.1: annotated, no defaults, no *args, tensors first, allowed attribute types, return annotation."""
    sig = inspect.signature(fn)
    tensors, attrs, seen_attr = [], {}, False
    for i, (name, p) in enumerate(sig.parameters.items()):
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise StandInError(f"Argument {name} is not a positional-or-keyword or keyword-only arg")
        if p.annotation is inspect.Parameter.empty:
            raise StandInError(f"Argument {name} does not have a type annotation")
        if p.default is not inspect.Parameter.empty:
            raise StandInError(f"Argument {name} has a default value")
        if p.annotation is TensorDesc:
            if seen_attr:
                raise StandInError("TensorDescs args and attribute args cannot be interspersed")
            tensors.append(name)
        else:
            if i == 0:
                raise StandInError("TensorDescs args should come first, followed by attributes")
            if name in FORBIDDEN_ATTRS:
                raise StandInError(f"'{name}' is not allowed as a plugin attribute name")
            if p.annotation not in ATTR_TYPES:
                raise StandInError(f"Attribute '{name}' of type {p.annotation} is not a supported type")
            attrs[name] = p.annotation
            seen_attr = True
    ret = sig.return_annotation
    if ret is inspect.Signature.empty:
        raise StandInError("No return annotation found for register function")
    if typing.get_origin(ret) is tuple:
        args = typing.get_args(ret)
        if any(a is Ellipsis or a is not TensorDesc for a in args):
            raise StandInError(f"Return annotation {ret} must list TensorDesc exactly")
        n_out = len(args)
    elif ret is TensorDesc:
        n_out = 1
    else:
        raise StandInError(f"Return argument is of type {ret}")
    return tensors, attrs, n_out


def check_aot_impl(fn: Callable, tensors: Sequence[str], attrs: Dict[str, type]) -> None:
    """§2.4: exactly (tensors, every attribute in register order, outputs, tactic); 4-tuple return annotation."""
    sig = inspect.signature(fn)
    expected = list(tensors) + list(attrs) + ["outputs", "tactic"]
    if list(sig.parameters) != expected:
        raise StandInError(f"aot_impl parameters {list(sig.parameters)} != {expected}")
    for name, p in sig.parameters.items():
        if name in attrs and p.annotation is not inspect.Parameter.empty and p.annotation is not attrs[name]:
            raise StandInError(f"Attribute '{name}' has a type annotation different from the registered one")
        if name == "tactic" and p.annotation is not inspect.Parameter.empty and p.annotation is not int:
            raise StandInError("'tactic' input argument should be an int")
    ret = sig.return_annotation
    if ret is inspect.Signature.empty:
        raise StandInError("No return annotation found for aot_impl function")
    args = typing.get_args(ret)
    if typing.get_origin(ret) is not tuple or len(args) != 4:
        raise StandInError(f"Return annotation is {ret}; expected a 4-tuple")
    for a in args[:2]:
        members = typing.get_args(a) or (a,)
        if not all(m in (str, bytes) for m in members):
            raise StandInError(f"Return annotation member {a} must be str, bytes or their Union")
    if not (inspect.isclass(args[2]) and issubclass(args[2], KernelLaunchParams)):
        raise StandInError("Return annotation's third member must be KernelLaunchParams")
    if not (inspect.isclass(args[3]) and issubclass(args[3], SymExprs)):
        raise StandInError("Return annotation's fourth member must be a SymExprs class")


def run_descriptor(fn: Callable, descs: Sequence[TensorDesc], attrs: Dict[str, Any], fake: bool) -> Tuple[TensorDesc, ...]:
    """TensorRT's two calls: the dtype pass (fake shapes, no build) and the shape pass (in a build)."""
    if fake:
        out = fn(*descs, **attrs)
    else:
        with building():
            out = fn(*descs, **attrs)
    return out if isinstance(out, tuple) else (out,)


def run_aot_impl(fn: Callable, descs: Sequence[TensorDesc], attr_values: Sequence[Any],
                 outputs: Sequence[TensorDesc], tactic: int = 0) -> Dict[str, Any]:
    """Call ``aot_impl`` as TensorRT does (positionally, all attributes, in a build) and check its result."""
    with building():
        name, ptx, params, extras = fn(*descs, *attr_values, tuple(outputs), tactic)
    if not isinstance(name, (str, bytes)):
        raise StandInError(f"Kernel name must be a 'str' or 'bytes'. Got: {type(name)}")
    if not isinstance(ptx, (str, bytes)):
        raise StandInError(f"PTX must be a 'str' or 'bytes'. Got: {type(ptx)}")
    if not isinstance(params, KernelLaunchParams):
        raise StandInError(f"Launch params must be a KernelLaunchParams. Got: {type(params)}")
    if not isinstance(extras, SymExprs):
        raise StandInError(f"Extra args must be a SymExprs. Got: {type(extras)}")
    for e in extras:
        if not isinstance(e, SymInt32):
            raise StandInError(f"Extra args must be a 'tensorrt.plugin.SymInt32'. Got: {type(e)}")
    return {
        "name": name if isinstance(name, str) else name.decode(),
        "ptx": ptx if isinstance(ptx, str) else ptx.decode(),
        "grid": (params.grid_x.value, params.grid_y.value, params.grid_z.value),
        "block": (params.block_x.value, params.block_y.value, params.block_z.value),
        "shared_mem": params.shared_mem.value,
        "extras": [e.value for e in extras],
    }
