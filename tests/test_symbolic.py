"""The expression language: one expression, evaluated on ints and on SymInts."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch._dynamo.source import ConstantSource

from fxkern import symbolic as sym


def symint(env, name, hint):
    s = env.create_symbol(hint, source=ConstantSource(name))
    return env.create_symintnode(s, hint=hint)


@given(st.integers(0, 10**6), st.integers(1, 1024))
def test_cdiv_on_ints(a, b):
    f = sym.compile_expr(sym.cdiv(sym.Dim(sym.INPUT, 0, 0), b))
    assert f(([(a,)], ())) == -(-a // b)


def test_same_expression_on_symints_stays_symbolic():
    env = ShapeEnv()
    n, d = symint(env, "n", 37), symint(env, "d", 1000)
    expr = sym.cdiv(sym.Prod(sym.INPUT, 0), 256) * 2 + sym.Dim(sym.INPUT, 0, -1) // 8
    value = sym.compile_expr(expr)(([(n, d)], ()))
    assert isinstance(value, torch.SymInt)
    assert value.node.hint == (-(-37000 // 256)) * 2 + 1000 // 8
    assert {str(s) for s in value.node.expr.free_symbols} == {str(n.node.expr), str(d.node.expr)}


def test_reflected_operators_and_lifting():
    e = 3 + sym.Dim(sym.OUTPUT, 0, 0) * 2
    assert sym.compile_expr(e)(((), [(5,)])) == 13
    with pytest.raises(TypeError):
        sym.Dim(sym.INPUT, 0, 0) + 1.5


def test_no_truth_value():
    with pytest.raises(TypeError, match="no truth value"):
        bool(sym.Dim(sym.INPUT, 0, 0))


def test_axis_out_of_range_is_an_error():
    with pytest.raises(IndexError, match="rank 2"):
        sym.compile_expr(sym.Dim(sym.INPUT, 0, 3))(([(2, 3)], ()))


def test_prod_of_scalar_tensor_is_one():
    assert sym.compile_expr(sym.Prod(sym.INPUT, 0))(([()], ())) == 1


class Recording(sym.Arithmetic):
    """An interpreter that records the operations it is asked for (the seam TensorRT uses)."""

    def __init__(self):
        self.ops = []

    def const(self, v):
        self.ops.append(("const", v))
        return v

    def cdiv(self, a, b):
        self.ops.append(("cdiv", a, b))
        return super().cdiv(a, b)


def test_other_interpreters_plug_in():
    arith = Recording()
    f = sym.compile_expr(sym.cdiv(sym.Prod(sym.INPUT, 0), 256), arith)
    assert f(([(10, 100)], ())) == 4
    assert ("const", 256) in arith.ops and ("cdiv", 1000, 256) in arith.ops
