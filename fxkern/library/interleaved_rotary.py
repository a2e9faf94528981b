"""The interleaved rotary embedding: columns ``2i`` and ``2i + 1`` of a head rotated as a pair.

GPT-J and CodeGen (``rotate_every_two``), GLM and GLM-4, and Cohere 1 and 2 (each its own
``rotate_half``) write::

    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    q_embed = (q * cos) + (rot * sin)

with ``cos`` and ``sin`` whose columns come in equal pairs (``repeat_interleave(2, -1)`` of a half-width
table, built once per forward and left to PyTorch: it is ``1/heads`` of the rotation's bytes). This is
not :mod:`~fxkern.library.rotary`'s computation (which pairs column ``i`` with ``i + D/2``) but the
same memory traffic, so the same kernel runs it: ``rotary_rows`` with ``PAIRS``, where an item is two
neighbouring 16-byte packs of whole pairs with their cos and sin packs. The ops read queries and keys where the projection left them (GLM's
``view(...).transpose(1, 2)``; GPT-J rotates its ``(B, S, H, D)`` view before the transpose) and lay
out their results as eager does (rotary.like_eager).

GPT-J (``rotary_dim``) and GLM/GLM-4 (``partial_rotary_factor``) rotate only the first ``rotary_dim``
columns and concatenate the rest back: ``partial_interleaved_rotary_embedding``, slices, rotation and
``cat`` in one op (and its whole-head form, where export keeps the empty slice and the ``cat``).

Cohere's 16-bit models rotate ``q.float()`` against 16-bit tables and cast the result back:
``interleaved_rotary_embedding_float32``, the same kernel rounding each product and sum to float32.

ERNIE 4.5 keeps float32 tables beside 16-bit queries and casts both products' operands to float32
(``q.float() * cos + rotate_half(q).float() * sin``, then ``.to(dtype)``):
``interleaved_rotary_embedding_float32_tables``, the kernel reading float32 tables. In its float32
models the casts do nothing but stay in the export IR as ``aten.to`` nodes (and rotate_half's slices
read the first, which is ``q`` itself): the same pattern traced in float32 runs the plain op.

Numbers: eager's roundings are kept, as in rotary.py, so results equal eager's to the bit in every
dtype. Not matched: the keys' rotation fused with grouped-query attention's ``repeat_kv`` (two ops:
``repeat_kv`` matches the copy).
"""

from __future__ import annotations

import dataclasses

import torch

from fxkern.errors import KernelInputError
from fxkern.library import rotary
from fxkern.library._rules import COMPILE_FREE_IRS, DTYPES, NAMESPACE, SIXTEEN_BIT, add_rule
from fxkern.ops import cuda_kernel_op
from fxkern.spec import Custom, DimSize, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput

SOURCE = rotary.SOURCE + r"""
// The ops' own kernels (what a TensorRT plugin launches): x contiguous (B, A1, A2, D), its first
// rotary_dim columns (even) rotated in pairs (2i, 2i + 1), the rest copied; n: x's numel. M: the type
// eager rounds each product and sum to (fxk::rope_pairs).
namespace fxk {
template <typename T, typename M>
__device__ __forceinline__ void interleaved(const T* x, const T* cs, const T* sn, int rotary_dim, int n, int A1,
                                            int A2, int D, int cB, int cH, int cS, T* y) {
    if (D <= 0 || A1 <= 0 || A2 <= 0) return;
    rotary<T, false, 1, true, M>(x, cs, sn, rotary_dim / 2, D - rotary_dim, n / (A1 * A2 * D),
                                 contiguous_rows(A1, A2, D), cB, cH, cS, 1, y);
}
}  // namespace fxk

template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary(const T* x, const T* cs, const T* sn, int n, int A1, int A2,
                                                          int D, int cB, int cH, int cS, T* y) {
    fxk::interleaved<T, T>(x, cs, sn, D, n, A1, A2, D, cB, cH, cS, y);
}

template <typename T>
__global__ void __launch_bounds__(128) partial_interleaved_rotary(const T* x, const T* cs, const T* sn, int rotary_dim,
                                                                  int n, int A1, int A2, int D, int cB, int cH, int cS,
                                                                  T* y) {
    fxk::interleaved<T, T>(x, cs, sn, rotary_dim, n, A1, A2, D, cB, cH, cS, y);
}

// Cohere's 16-bit models: x rotated in float32 (a float32 copy of x against 16-bit tables), then rounded.
template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary_float32(const T* x, const T* cs, const T* sn, int n, int A1,
                                                                  int A2, int D, int cB, int cH, int cS, T* y) {
    fxk::interleaved<T, float>(x, cs, sn, D, n, A1, A2, D, cB, cH, cS, y);
}

// ERNIE 4.5's 16-bit models: x and its rotation cast to float32 against float32 tables, the sum rounded once.
template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary_float32_tables(const T* x, const float* cs, const float* sn,
                                                                         int n, int A1, int A2, int D, int cB, int cH,
                                                                         int cS, T* y) {
    if (D <= 0 || A1 <= 0 || A2 <= 0) return;
    fxk::rotary<T, false, 1, true, float, float>(x, cs, sn, D / 2, 0, n / (A1 * A2 * D), fxk::contiguous_rows(A1, A2, D),
                                                 cB, cH, cS, 1, y);
}

// What the ops run in eager PyTorch: rotary_strided's walk (x read where it lies), pairs rotated.
template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary_strided(const T* x_span, const T* cs, const T* sn, int half,
                                                                  int pass, int B, int A1, int A2, int sB, int s1,
                                                                  int s2, int heads_inner, int n_rep, int in_order,
                                                                  int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false, 2, true>(x_span, cs, sn, half, pass, B,
                                   fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS, n_rep, y);
}

template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary_strided_float32(const T* x_span, const T* cs, const T* sn,
                                                                          int half, int pass, int B, int A1, int A2,
                                                                          int sB, int s1, int s2, int heads_inner,
                                                                          int n_rep, int in_order, int cB, int cH,
                                                                          int cS, T* y) {
    fxk::rotary<T, false, 2, true, float>(x_span, cs, sn, half, pass, B,
                                          fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS, n_rep,
                                          y);
}

template <typename T>
__global__ void __launch_bounds__(128) interleaved_rotary_strided_float32_tables(
        const T* x_span, const float* cs, const float* sn, int half, int pass, int B, int A1, int A2, int sB, int s1,
        int s2, int heads_inner, int n_rep, int in_order, int cB, int cH, int cS, T* y) {
    fxk::rotary<T, false, 2, true, float, float>(x_span, cs, sn, half, pass, B,
                                                 fxk::rows_of(A1, A2, sB, s1, s2, heads_inner, in_order), cB, cH, cS,
                                                 n_rep, y);
}
"""

_TABLE_DIMS = [DimSize("cos", 0), DimSize("cos", 1), DimSize("cos", 2)]
_X_DIMS = [Numel("x"), DimSize("x", 1), DimSize("x", 2), DimSize("x", 3)]
# x (B, H, S, D) contiguous; cos and sin (cB, cH, cS, D), each of cB, cH, cS 1 or x's size.
INTERLEAVED_ROTARY = KernelSpec(
    SOURCE, "interleaved_rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin")],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[*_X_DIMS, *_TABLE_DIMS],
    geometry=Custom(rotary.rotary_geometry),
    dtypes=DTYPES,
)
# The first rotary_dim columns rotated, the rest copied; cos and sin (cB, cH, cS, rotary_dim).
PARTIAL_INTERLEAVED_ROTARY = KernelSpec(
    SOURCE, "partial_interleaved_rotary",
    inputs=[InputDecl("x"), InputDecl("cos"), InputDecl("sin"), ScalarInput("rotary_dim", int)],
    outputs=[OutputDecl("y", SameAs("x"))],
    extras=[*_X_DIMS, *_TABLE_DIMS],
    geometry=Custom(rotary.rotary_geometry),
    dtypes=DTYPES,
)
# The same rotating in float32 (x, cos and sin of one 16-bit dtype; for float32, the same numbers).
INTERLEAVED_ROTARY_FLOAT32 = dataclasses.replace(INTERLEAVED_ROTARY, kernel_name="interleaved_rotary_float32")
# The ops in eager PyTorch: rotary.ROTARY_STRIDED's arguments, pairs rotated.
INTERLEAVED_ROTARY_STRIDED = dataclasses.replace(rotary.ROTARY_STRIDED, kernel_source=SOURCE,
                                                 kernel_name="interleaved_rotary_strided")
INTERLEAVED_ROTARY_STRIDED_FLOAT32 = dataclasses.replace(INTERLEAVED_ROTARY_STRIDED,
                                                         kernel_name="interleaved_rotary_strided_float32")
# ERNIE 4.5's: float32 cos and sin beside x (a float32 x: the plain op's numbers).
INTERLEAVED_ROTARY_FLOAT32_TABLES = dataclasses.replace(
    INTERLEAVED_ROTARY, kernel_name="interleaved_rotary_float32_tables",
    inputs=[InputDecl("x"), InputDecl("cos", dtype=torch.float32), InputDecl("sin", dtype=torch.float32)])
INTERLEAVED_ROTARY_STRIDED_FLOAT32_TABLES = dataclasses.replace(
    rotary.ROTARY_STRIDED_FLOAT32_TABLES, kernel_source=SOURCE, kernel_name="interleaved_rotary_strided_float32_tables")


# ---- the patterns (also the ops' CPU references) ---------------------------------------------------


def interleaved_rotary_embedding(x, cos, sin):
    """GPT-J's ``apply_rotary_pos_emb`` (and GLM's and Cohere's) for one of q, k:
    ``(x * cos) + (rotate_every_two(x) * sin)``, with ``rotate_every_two(x) =
    torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)``."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return (x * cos) + (torch.stack((-x2, x1), dim=-1).flatten(-2) * sin)


def interleaved_rotary_embedding_float32(x, cos, sin):
    """Cohere's ``apply_rotary_pos_emb`` for 16-bit queries: ``q = q.float()``, rotated against tables of
    q's dtype (their products promote to float32), ``.to(dtype)``."""
    return interleaved_rotary_embedding(x.float(), cos, sin).to(x.dtype)


def interleaved_rotary_embedding_float32_tables(x, cos, sin):
    """ERNIE 4.5's ``apply_rotary_pos_emb`` for 16-bit q or k: float32 cos and sin, q and its rotation
    cast to float32, ``(q.float() * cos) + (rotate_half(q).float() * sin)``, cast back. In that order:
    in float32, ``q.float()`` is ``q`` itself, so export records rotate_half's slices as reading the cast."""
    dtype = x.dtype
    rotated = x.float() * cos
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return (rotated + (torch.stack((-x2, x1), dim=-1).flatten(-2).float() * sin)).to(dtype)


def partial_interleaved_rotary_embedding(x, cos, sin, rotary_dim: int):
    """GPT-J's and GLM-4's partial rotation: the first ``rotary_dim`` columns rotated in pairs, the rest
    concatenated back."""
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([interleaved_rotary_embedding(x_rot, cos, sin), x_pass], dim=-1)


def whole_interleaved_rotary_embedding(x, cos, sin, rotary_dim: int):
    """The same code with ``rotary_dim`` the whole head (GLM with ``partial_rotary_factor=1``): export
    drops the full slice and keeps the empty ``x[..., D:]`` and the ``cat``."""
    return torch.cat([interleaved_rotary_embedding(x, cos, sin), x[..., rotary_dim:]], dim=-1)


# ---- checks and outputs ----------------------------------------------------------------------------


def _check(x, cos, sin, op: str, rotary_dim: int | None = None, float32_tables: bool = False) -> None:
    """rotary._check's, with half the columns rotated (x's last axis, or rotary_dim) even: whole pairs."""
    rot = x.shape[-1] if rotary_dim is None and x.dim() == 4 else rotary_dim
    if isinstance(rot, int) and rot % 2:
        what = "rotary_dim" if rotary_dim is not None else "x's last axis"
        raise KernelInputError(f"{op}: {what} is {rot}, odd; the interleaved rotation turns columns 2i and 2i + 1 "
                               f"as a pair, so it rotates an even number of columns")
    rotary._check(x, cos, sin, rot // 2 if rot is not None else 0, op, rotary_dim, float32_tables=float32_tables)


def _output(x, cos, sin):
    """interleaved_rotary_embedding's output (and its fake impl): checks the call, a tensor of x's shape
    laid out as eager's (rotary.like_eager)."""
    _check(x, cos, sin, f"{NAMESPACE}::interleaved_rotary_embedding")
    return rotary.like_eager(x)


def _float32_output(x, cos, sin):
    """interleaved_rotary_embedding_float32's output (and its fake impl): as interleaved_rotary_embedding's."""
    _check(x, cos, sin, f"{NAMESPACE}::interleaved_rotary_embedding_float32")
    return rotary.like_eager(x)


def _float32_tables_output(x, cos, sin):
    """interleaved_rotary_embedding_float32_tables' output (and its fake impl): as interleaved_rotary_embedding's,
    cos and sin float32."""
    _check(x, cos, sin, f"{NAMESPACE}::interleaved_rotary_embedding_float32_tables", float32_tables=True)
    return rotary.like_eager(x)


def _partial_output(x, cos, sin, rotary_dim):
    """partial_interleaved_rotary_embedding's output (and its fake impl): contiguous, as eager's ``cat``."""
    _check(x, cos, sin, f"{NAMESPACE}::partial_interleaved_rotary_embedding", rotary_dim)
    return x.new_empty(x.shape)


# ---- the rules ------------------------------------------------------------------------------------


def _fakes(match):
    return tuple(match.bindings[n].meta.get("val") for n in ("x", "cos", "sin"))


def _head_size(x) -> int | None:
    return x.shape[3] if isinstance(x, torch.Tensor) and x.dim() == 4 and isinstance(x.shape[3], int) else None


def interleaved_operands(match) -> bool:
    """A filter: the matched x, cos and sin are what the kernels read (rotary.rotates), x's last axis
    even: whole pairs."""
    x, cos, sin = _fakes(match)
    d = _head_size(x)
    return d is not None and d % 2 == 0 and rotary.rotates(x, cos, sin, d // 2)


def partial_operands(match) -> bool:
    """A filter: as interleaved_operands, rotating the captured rotary_dim columns (even) of x's."""
    rotary_dim = match.bindings.get("rotary_dim")
    return (isinstance(rotary_dim, int) and rotary_dim % 2 == 0
            and rotary.rotates(*_fakes(match), rotary_dim // 2, rotary_dim))


def sixteen_bit_operands(match) -> bool:
    """A filter for the float32 form: as interleaved_operands, x 16-bit (in float32 its pattern is the
    plain one's, which the plain op takes)."""
    return interleaved_operands(match) and _fakes(match)[0].dtype != torch.float32


def float32_table_operands(match) -> bool:
    """A filter for ERNIE's form: 16-bit x, float32 cos and sin, otherwise as interleaved_operands."""
    x, cos, sin = _fakes(match)
    d = _head_size(x)
    return (d is not None and d % 2 == 0 and x.dtype != torch.float32
            and rotary.rotates(x, cos, sin, d // 2, tables=torch.float32))


def whole_operands(match) -> bool:
    """A filter for the whole-head form: as interleaved_operands, the empty slice starting at x's last axis."""
    return interleaved_operands(match) and match.bindings.get("rotary_dim") == _head_size(_fakes(match)[0])


# Traced at rank 4 (the slices' axis is a literal 3); the partial forms rotate 74 columns of 90. Their
# batch, heads and positions differ from each other and from 1: core ATen writes flatten(-2) as a view
# to x_rot's sizes, each found as a size (patterns.sized_sites) where a 1 would stay a literal.
_EXAMPLE = (torch.zeros(1, 2, 1, 74), torch.zeros(1, 1, 1, 74), torch.zeros(1, 1, 1, 74))
_PARTIAL_EXAMPLE = (torch.zeros(3, 2, 5, 90), torch.zeros(3, 1, 5, 74), torch.zeros(3, 1, 5, 74), 74)
_WHOLE_EXAMPLE = (torch.zeros(3, 2, 5, 74), torch.zeros(3, 1, 5, 74), torch.zeros(3, 1, 5, 74), 74)


def _examples_in(dtype):
    """_EXAMPLE in the matched graph's dtype: the float32 form's casts are literals of it."""
    return tuple(t.to(dtype) for t in _EXAMPLE)


def _float32_tables_examples(dtype):
    """_EXAMPLE with x in the matched graph's dtype (the cast back is a literal of it), the tables float32."""
    return (_EXAMPLE[0].to(dtype), *_EXAMPLE[1:])


def register(rules) -> None:
    # Not inside inductor (its pointwise kernel is one pass too). The partial form before the plain
    # rotation it holds.
    schema, meta_fn = rotary._STRIDED_SCHEMA, rotary._strided_output
    (strided,) = rotary.launchers(((f"{NAMESPACE}::_interleaved_rotary_strided", INTERLEAVED_ROTARY_STRIDED),),
                                  rotary.strided_reference(interleaved_rotary_embedding), meta_fn, schema)
    (strided_float32,) = rotary.launchers(
        ((f"{NAMESPACE}::_interleaved_rotary_strided_float32", INTERLEAVED_ROTARY_STRIDED_FLOAT32),),
        rotary.strided_reference(interleaved_rotary_embedding_float32), meta_fn, schema)

    def op(name, spec, reference, output, launch=strided):
        qualname = f"{NAMESPACE}::{name}"
        return cuda_kernel_op(qualname, spec, reference=reference, meta_fn=output,
                              eager_fn=rotary._eager(qualname, (launch, launch), output, rotated=True),
                              past_limits="reference")

    def rule(pattern, target, accept, example, dtypes=None):
        add_rule(rules, pattern, target, pattern.__name__, filter=accept, irs=COMPILE_FREE_IRS, example_inputs=example,
                 dtypes=dtypes)

    partial = op("partial_interleaved_rotary_embedding", PARTIAL_INTERLEAVED_ROTARY,
                 partial_interleaved_rotary_embedding, _partial_output)
    rule(partial_interleaved_rotary_embedding, partial, partial_operands, _PARTIAL_EXAMPLE)
    rule(whole_interleaved_rotary_embedding, partial, whole_operands, _WHOLE_EXAMPLE)
    plain = op("interleaved_rotary_embedding", INTERLEAVED_ROTARY, interleaved_rotary_embedding, _output)
    rule(interleaved_rotary_embedding, plain, interleaved_operands, _EXAMPLE)
    float32 = op("interleaved_rotary_embedding_float32", INTERLEAVED_ROTARY_FLOAT32,
                 interleaved_rotary_embedding_float32, _float32_output, strided_float32)
    rule(interleaved_rotary_embedding_float32, float32, sixteen_bit_operands, _examples_in, SIXTEEN_BIT)
    (strided_float32_tables,) = rotary.launchers(
        ((f"{NAMESPACE}::_interleaved_rotary_strided_float32_tables", INTERLEAVED_ROTARY_STRIDED_FLOAT32_TABLES),),
        rotary.strided_reference(interleaved_rotary_embedding_float32_tables), meta_fn, schema)
    float32_tables = op("interleaved_rotary_embedding_float32_tables", INTERLEAVED_ROTARY_FLOAT32_TABLES,
                        interleaved_rotary_embedding_float32_tables, _float32_tables_output, strided_float32_tables)
    rule(interleaved_rotary_embedding_float32_tables, float32_tables, float32_table_operands, _float32_tables_examples,
         SIXTEEN_BIT)
    # The same code in a float32 model: its casts do nothing there but stay in the export IR as aten.to
    # nodes, which the plain rule's pattern lacks (ERNIE 4.5's float32 rotations went unmatched). Its
    # numbers are the plain rotation's, so the plain op takes it.
    add_rule(rules, interleaved_rotary_embedding_float32_tables, plain, "interleaved_rotary_embedding_float32_casts",
             filter=interleaved_operands, irs=COMPILE_FREE_IRS, example_inputs=_float32_tables_examples,
             dtypes=(torch.float32,))
