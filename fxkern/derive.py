"""From a KernelSpec to a KernelPlan: everything the spec implies, derived once.

The plan holds the calling convention (one :class:`Param` per kernel
argument), the schema, the output shapes, extras and launch geometry as
:mod:`fxkern.symbolic` expressions, and the dtype rules. The launcher, the
fake impl and the TensorRT plugin all read the plan; none re-derives it.
Validation lives here too, so a malformed spec fails at registration with
an error naming the field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from fxkern import symbolic as sym
from fxkern.errors import SignatureMismatch, SpecError
from fxkern.spec import (
    Custom,
    DimSize,
    Elementwise,
    InputDecl,
    KernelSpec,
    Numel,
    OutputDecl,
    ReduceDims,
    Reduction,
    SameAs,
    ScalarInput,
)

# C++ spelling of each element type a templated kernel can be instantiated for.
CTYPES: Dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float64: "double",
    torch.int32: "int",
    torch.int64: "long long",
    torch.int16: "short",
    torch.int8: "signed char",
    torch.uint8: "unsigned char",
    torch.bool: "bool",
}

SCALAR_KINDS = {float: "f32", int: "i32", bool: "bool"}
SCHEMA_TYPES = {float: "float", int: "int", bool: "bool"}
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Param:
    """One kernel parameter of the calling convention.

    ``kind`` is ``pointer``, ``f32``, ``i32`` or ``bool``; ``role`` is
    ``input``, ``scalar``, ``extra`` or ``output``; ``label`` is what an
    error message calls it (``input x``, ``extra Numel('x')``...); ``name``
    the spec's name for it (an extra has none).
    """

    kind: str
    role: str
    label: str
    name: Optional[str] = None


@dataclass(frozen=True)
class KernelPlan:
    spec: KernelSpec
    inputs: Tuple[Any, ...]  # InputDecl | ScalarInput, declaration order
    tensor_positions: Tuple[int, ...]  # argument positions of tensor inputs
    tensor_decls: Tuple[InputDecl, ...]
    output_names: Tuple[str, ...]
    output_shapes: Optional[Tuple[sym.ShapeExpr, ...]]  # None: meta_fn decides
    output_dtype_from: Tuple[Optional[int], ...]  # tensor index, or None: the call dtype
    extras: Tuple[sym.Expr, ...]
    grid: Optional[Tuple[sym.Expr, sym.Expr, sym.Expr]]
    block: Optional[Tuple[int, int, int]]
    shared_mem: sym.Expr
    min_out_rank: int  # nd geometry needs this many output axes
    # per tensor input, the axes the plan reads: (rank needed, what reads it), or None
    input_ranks: Tuple[Optional[Tuple[int, str]], ...]
    elementwise: bool
    dtypes: Optional[Tuple[torch.dtype, ...]]
    params: Tuple[Param, ...]
    schema: str

    @property
    def kernel_name(self) -> str:
        return self.spec.kernel_name

    def name_expression(self, dtype: Optional[torch.dtype]) -> str:
        """The NVRTC name expression of the kernel instantiated for ``dtype``."""
        if self.dtypes is None:
            return self.spec.kernel_name
        return f"{self.spec.kernel_name}<{CTYPES[dtype]}>"

    def name_expressions(self) -> Tuple[str, ...]:
        if self.dtypes is None:
            return (self.spec.kernel_name,)
        return tuple(self.name_expression(d) for d in self.dtypes)


def _fail(field: str, message: str) -> SpecError:
    return SpecError(f"KernelSpec.{field}: {message}")


def _declaration(source: str, name: str) -> Tuple[Optional[str], str]:
    """How ``source`` declares function ``name`` in plain text: ``("__global__", head)`` with the text
    from the end of the statement or block before it up to its name, ``("__device__", head)`` for a
    device function of that name and no kernel, or ``(None, "")`` (a macro may declare it, and where a
    ``#define`` holds ``__global__`` kernels are left to NVRTC). Lets a
    name typo or a template without dtypes get an error of its own, where NVRTC's name lookup failed
    with errors about ``__nv_name_map`` (found by a usability test)."""
    if re.search(r"^[ \t]*#[ \t]*define\b(?:[^\n]*\\\n)*[^\n]*__global__", source, flags=re.M):
        return None, ""  # kernels declared through macros: NVRTC knows better
    device = None
    for m in re.finditer(rf"(?<!\w){re.escape(name)}\s*\(", source):
        start = max(source.rfind(c, 0, m.start()) for c in ";{}")
        head = source[start + 1:m.start()]
        if re.search(r"\b__global__\b", head):
            return "__global__", head
        if device is None and re.search(r"\b__device__\b", head):
            device = head
    return ("__device__", device) if device is not None else (None, "")


# NVRTC's --std values (its option of that name); anything else failed in NVRTC without the field's name
_STANDARDS = ("c++03", "c++11", "c++14", "c++17", "c++20")


def _check_compile_options(spec: KernelSpec) -> None:
    """``compile_std`` and ``arch_override`` checked here, where the error can name the field: NVRTC
    said only "invalid value for --std" or "--gpu-architecture" (found by a probe)."""
    if spec.compile_std not in _STANDARDS:
        raise _fail("compile_std", f"{spec.compile_std!r} is not a standard NVRTC takes; use one of {', '.join(_STANDARDS)}")
    if spec.arch_override is None:
        return
    from fxkern import compiler
    from fxkern.errors import CompileError

    try:
        arch = compiler.normalize_arch(spec.arch_override)
    except CompileError as exc:
        raise _fail("arch_override", f"{exc} (or None: the GPU's own arch)") from None
    supported = compiler.supported_archs()
    number = int(re.match(r"sm_(\d+)", arch).group(1))
    if supported and number not in supported:
        raise _fail("arch_override", f"{spec.arch_override!r} is not an arch this NVRTC compiles for; it takes "
                                     f"{', '.join(f'sm_{a}' for a in supported)}")


# The element size of a C++ pointer parameter, where the spelling names a scalar type (a template's T,
# a vector type or a struct does not). Sizes, not types, are compared: a bool mask read as unsigned
# char, or float32 bits read as int, are the author's choice (found by a review).
_POINTEE_SIZE = {"float": 4, "double": 8, "__half": 2, "half": 2, "__nv_bfloat16": 2, "nv_bfloat16": 2,
                 "int": 4, "unsigned int": 4, "unsigned": 4, "int32_t": 4, "uint32_t": 4,
                 "long long": 8, "long long int": 8, "unsigned long long": 8, "long": 8, "int64_t": 8, "uint64_t": 8,
                 "short": 2, "unsigned short": 2, "int16_t": 2, "uint16_t": 2,
                 "char": 1, "signed char": 1, "unsigned char": 1, "int8_t": 1, "uint8_t": 1, "bool": 1}


def _pointer_dtypes(inputs: Sequence[Any], n_extras: int, dtypes: Optional[Tuple[torch.dtype, ...]],
                    out_dtype_from: Optional[Sequence[Any]], tensor_decls: Sequence[InputDecl], n_outputs: int) -> list:
    """Per kernel parameter: the one element type its tensor has, or None (a scalar, an extra, an
    output of a schema, or a dtype each call decides: a templated kernel's T)."""
    call = torch.float32 if dtypes is None else (dtypes[0] if len(dtypes) == 1 else None)
    found = [(d.dtype or call) if isinstance(d, InputDecl) else None for d in inputs] + [None] * n_extras
    for j in range(n_outputs):
        src = out_dtype_from[j] if out_dtype_from is not None else None
        found.append(None if out_dtype_from is None else (tensor_decls[src].dtype or call) if src is not None else call)
    return found


def _declared_parameters(code: str, name: str) -> Optional[list]:
    """The parameters of the ``__global__`` function ``name`` as written: (name, pointee type or None
    for a value), or None where they cannot be read plainly."""
    for m in re.finditer(rf"(?<!\w){re.escape(name)}\s*\(", code):
        start = max(code.rfind(c, 0, m.start()) for c in ";{}")
        if not re.search(r"\b__global__\b", code[start + 1:m.start()]):
            continue
        depth, i, parts, begin = 1, m.end(), [], m.end()
        while i < len(code) and depth:
            c = code[i]
            if c in "(<[":
                depth += 1
            elif c in ")>]":
                depth -= 1
            if (c == "," and depth == 1) or depth == 0:
                parts.append(code[begin:i])
                begin = i + 1
            i += 1
        found = []
        for part in parts:
            part = part.split("=")[0].strip()
            if not part:
                continue
            word = re.search(r"(\w+)\s*(\[\s*\])?$", part)
            if word is None:
                return None
            head = part[:word.start()]
            pointee = None
            if "*" in head or word.group(2):
                pointee = " ".join(re.sub(r"\b(const|volatile|__restrict__|__restrict|restrict|struct)\b|\*", " ",
                                          head).split())
            found.append((word.group(1), pointee))
        return found
    return None


def _type_aliases(code: str) -> Dict[str, str]:
    """The source's names for scalar types: ``typedef double real;``, ``using real = double;`` and
    ``#define real double`` (a ``const real* x`` is read as the type it names; a review found the
    check blind to such names)."""
    found: Dict[str, str] = {}
    for m in re.finditer(r"\btypedef\s+([\w\s]+?)\s+(\w+)\s*;|\busing\s+(\w+)\s*=\s*([\w\s]+?)\s*;"
                         r"|^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+([\w \t]+?)[ \t]*$", code, flags=re.M):
        name, target = (m.group(2), m.group(1)) if m.group(2) else (m.group(3), m.group(4)) if m.group(3) else (m.group(5), m.group(6))
        found[name] = " ".join(re.sub(r"\b(const|volatile)\b", " ", target).split())
    # a template's parameter of the same name is its own type (a typedef double scalar_t beside a
    # template <typename scalar_t> kernel; found by a review)
    for m in re.finditer(r"\b(?:typename|class)\s+(\w+)", code):
        found.pop(m.group(1), None)
    return found


def _unaliased(pointee: str, aliases: Dict[str, str]) -> str:
    """``pointee`` with the source's type aliases followed (a few steps: aliases of aliases)."""
    for _ in range(8):
        if pointee not in aliases:
            break
        pointee = aliases[pointee]
    return pointee


def _check_declared_parameters(kernel: str, code: str, params: Sequence["Param"], dtypes: list) -> None:
    """The kernel's own parameter list against the calling convention, where PTX cannot tell: every
    pointer is .u64 there, so ``(const float* b, const float* a, ...)`` for inputs ``[a, b]`` ran
    b - a, and ``const double* x`` for a float32 input read its bytes as doubles (found by a probe). A
    parameter named as the spec names another of the same role (input, scalar, output), or a pointer
    to elements of another size than its tensor's, is an error; other names are the author's."""
    declared = _declared_parameters(code, kernel)
    if declared is None or len(declared) != len(params):
        return  # the count is checked against the PTX, with a message of its own
    convention = ", ".join(p.label for p in params)
    aliases = _type_aliases(code)
    at = {(p.role, p.name): j for j, p in enumerate(params) if p.name is not None}
    for i, ((name, pointee), want) in enumerate(zip(declared, params)):
        j = at.get((want.role, name))
        if want.name is not None and name != want.name and j is not None:
            raise SignatureMismatch(
                f"kernel {kernel!r}, parameter {i} is named {name!r}, but the spec puts {want.label} there and "
                f"{params[j].label} at parameter {j}: fxkern passes arguments in this order: "
                f"({convention}); reorder the kernel's parameters or the spec's inputs")
        expected = dtypes[i] if i < len(dtypes) else None
        real = _unaliased(pointee, aliases) if pointee else None
        size = _POINTEE_SIZE.get(real) if real else None
        if expected is not None and size is not None and size != expected.itemsize:
            spelled = pointee if real == pointee else f"{pointee} ({real})"
            raise SignatureMismatch(
                f"kernel {kernel!r}, parameter {i} ({name}) points to {spelled}, {size}-byte elements, but "
                f"{want.label} is a {expected} tensor ({expected.itemsize}-byte elements): declare it as "
                f"{CTYPES[expected]}*, or " + ("set OutputDecl.dtype_from to the input whose dtype it has"
                                               if want.role == "output" else "pin the input's dtype with InputDecl.dtype"))


def _resolve_tensor(ref: Any, tensor_decls: Sequence[InputDecl], field: str) -> int:
    names = [d.name for d in tensor_decls]
    if isinstance(ref, bool) or not isinstance(ref, (int, str)):
        raise _fail(field, f"refer to a tensor input by name or index, not {ref!r}")
    if isinstance(ref, int):
        if not 0 <= ref < len(tensor_decls):
            raise _fail(field, f"index {ref} is out of range: the tensor inputs are {names}")
        return ref
    if ref not in names:
        raise _fail(field, f"{ref!r} is not a tensor input; the tensor inputs are {names}")
    return names.index(ref)


def _check_dtype(dtype: Any, field: str) -> None:
    if not isinstance(dtype, torch.dtype) or dtype not in CTYPES:
        raise _fail(field, f"{dtype!r} is not a supported dtype; use one of {sorted(map(str, CTYPES))}")


def plan_kernel(
    spec: KernelSpec,
    *,
    has_meta_fn: bool = False,
    has_eager_fn: bool = False,
    schema: Optional[str] = None,
) -> KernelPlan:
    """Check ``spec`` and derive its plan. Raises :class:`SpecError` naming the field."""
    if not isinstance(spec, KernelSpec):
        raise SpecError(f"expected a fxkern.KernelSpec, got {type(spec).__name__}")
    if not isinstance(spec.kernel_source, str) or not spec.kernel_source.strip():
        raise _fail("kernel_source", "must be non-empty CUDA C++ source text")
    if not isinstance(spec.kernel_name, str) or not spec.kernel_name.isidentifier():
        raise _fail("kernel_name", f"{spec.kernel_name!r} is not a C identifier")
    if spec.kernel_name not in spec.kernel_source:
        raise _fail("kernel_name", f"{spec.kernel_name!r} does not appear in kernel_source")
    code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", spec.kernel_source, flags=re.S)  # a ';' or 'template' in a comment
    kind, declared = _declaration(code, spec.kernel_name)
    if kind is None and not re.search(rf"(?<!\w){spec.kernel_name}(?!\w)", code):
        longer = sorted(set(re.findall(rf"\w*{spec.kernel_name}\w*", code)))
        raise _fail("kernel_name", f"{spec.kernel_name!r} appears in kernel_source only inside other names "
                                   f"({', '.join(longer[:3])}); pass the __global__ function's whole name")
    if kind == "__device__":
        raise _fail("kernel_name", f"{spec.kernel_name!r} is a __device__ function, not a kernel; pass the name "
                                   f"of the __global__ function that calls it")
    if isinstance(spec.include_paths, (str, bytes)) or (spec.include_paths is not None
                                                        and not hasattr(spec.include_paths, "__iter__")):
        # a string was read as one directory per character (found by a probe)
        raise _fail("include_paths", f"is {spec.include_paths!r}: give a list of directories, e.g. [{str(spec.include_paths)!r}]")
    missing = [p for p in spec.include_paths or () if not os.path.isdir(p)]
    if missing:
        raise _fail("include_paths", f"{missing} is not a directory here")
    _check_compile_options(spec)
    inputs = tuple(spec.inputs or ())
    if not inputs:
        raise _fail("inputs", "declare at least one InputDecl")
    seen = set()
    for i, d in enumerate(inputs):
        if not isinstance(d, (InputDecl, ScalarInput)):
            raise _fail(f"inputs[{i}]", f"expected InputDecl or ScalarInput, got {d!r}")
        if not isinstance(d.name, str) or not d.name.isidentifier():
            raise _fail(f"inputs[{i}]", f"name {d.name!r} is not an identifier")
        if d.name in seen:
            raise _fail(f"inputs[{i}]", f"duplicate name {d.name!r}")
        seen.add(d.name)
        if isinstance(d, ScalarInput) and d.py_type not in SCALAR_KINDS:
            raise _fail(f"inputs[{i}]", f"ScalarInput {d.name!r}: py_type must be float, int or bool, not {d.py_type!r}")
        if isinstance(d, InputDecl) and d.dtype is not None:
            _check_dtype(d.dtype, f"inputs[{i}].dtype")
    tensor_positions = tuple(i for i, d in enumerate(inputs) if isinstance(d, InputDecl))
    tensor_decls = tuple(inputs[i] for i in tensor_positions)
    if not tensor_decls:
        raise _fail("inputs", "declare at least one tensor InputDecl (shapes are derived from tensors)")

    all_pinned = all(d.dtype is not None for d in tensor_decls)  # then no call has a dtype of its own
    dtypes = None
    if spec.dtypes is not None:
        if isinstance(spec.dtypes, torch.dtype):
            raise _fail("dtypes", f"is {spec.dtypes}, one dtype: give a list or tuple of them, e.g. [{spec.dtypes}]")
        dtypes = tuple(spec.dtypes)
        if not dtypes:
            raise _fail("dtypes", "is empty; leave it None for a float32-only kernel")
        for d in dtypes:
            _check_dtype(d, "dtypes")
        if len(set(dtypes)) != len(dtypes):
            raise _fail("dtypes", f"lists a dtype twice: {dtypes}")
        if all_pinned:
            raise _fail("dtypes", "every tensor input pins its dtype, so no call picks one of these "
                                  "instantiations; leave dtypes None, or unpin the input whose dtype varies")
    if kind == "__global__":  # a kernel written through a macro is left to NVRTC
        template = re.search(r"\btemplate\s*<", declared) is not None
        if spec.dtypes is not None and not template:
            raise _fail("dtypes", f"compiles {spec.kernel_name}<T> for each dtype, but the kernel is no template: "
                                  f"write it as template <typename T> __global__ void {spec.kernel_name}(...) "
                                  f"(not extern \"C\"), or leave dtypes None for a float32 kernel")
        if spec.dtypes is None and template:
            raise _fail("dtypes", f"{spec.kernel_name} is a template: give dtypes=(torch.float32, ...), one "
                                  f"instantiation a dtype, or write it for float32 without a template")

    # outputs
    outputs = tuple(spec.outputs or ())
    if not outputs and not has_meta_fn:
        raise _fail("outputs", "declare at least one OutputDecl, or pass meta_fn=")
    out_names, out_shapes, out_dtype_from = [], [], []
    for j, o in enumerate(outputs):
        if not isinstance(o, OutputDecl):
            raise _fail(f"outputs[{j}]", f"expected OutputDecl, got {o!r}")
        if not isinstance(o.name, str) or not o.name.isidentifier():
            raise _fail(f"outputs[{j}]", f"name {o.name!r} is not an identifier")
        if o.name in out_names or o.name in seen:
            raise _fail(f"outputs[{j}]", f"duplicate name {o.name!r}")
        out_names.append(o.name)
        rel = o.shape
        if isinstance(rel, SameAs):
            out_shapes.append(sym.ShapeOf(_resolve_tensor(rel.input_idx, tensor_decls, f"outputs[{j}].shape")))
        elif isinstance(rel, ReduceDims):
            idx = _resolve_tensor(rel.input_idx, tensor_decls, f"outputs[{j}].shape")
            dims = tuple(rel.dims) if isinstance(rel.dims, (tuple, list)) else (rel.dims,)
            if not dims or not all(isinstance(a, int) for a in dims):
                raise _fail(f"outputs[{j}].shape", f"ReduceDims.dims must be a non-empty tuple of ints, got {rel.dims!r}")
            out_shapes.append(sym.Reduced(idx, dims, bool(rel.keepdim)))
        else:
            raise _fail(f"outputs[{j}].shape", f"expected SameAs or ReduceDims, got {rel!r}")
        if o.dtype_from is None and all_pinned:
            # no call dtype when every input pins its own: the output takes the dtype of the input
            # whose shape it has (the CUDA path's empty_like did; the fake impl took input 0's)
            out_dtype_from.append(out_shapes[-1].index)
        elif o.dtype_from is None:
            out_dtype_from.append(None)
        else:
            out_dtype_from.append(_resolve_tensor(o.dtype_from, tensor_decls, f"outputs[{j}].dtype_from"))
    n_outputs = len(outputs)

    # extras
    extras = []
    for k, e in enumerate(spec.extras or ()):
        field = f"extras[{k}]"
        if isinstance(e, Numel):
            extras.append(sym.Prod(sym.INPUT, _resolve_tensor(e.input_name, tensor_decls, field)))
        elif isinstance(e, DimSize):
            if not isinstance(e.axis, int):
                raise _fail(field, f"DimSize.axis must be an int, got {e.axis!r}")
            extras.append(sym.Dim(sym.INPUT, _resolve_tensor(e.input_name, tensor_decls, field), e.axis))
        else:
            raise _fail(field, f"expected Numel or DimSize, got {e!r}")

    # geometry
    geom = spec.geometry
    grid = block = None
    shared_mem: sym.Expr = sym.Const(0)
    min_out_rank = 0
    if geom is None:
        if not has_eager_fn:
            raise _fail("geometry", "is required unless eager_fn= launches the kernel itself")
    elif isinstance(geom, Elementwise):
        blk = (geom.block,) if isinstance(geom.block, int) else tuple(geom.block) if hasattr(geom.block, "__iter__") else ()
        if not 1 <= len(blk) <= 3 or not all(isinstance(b, int) and b > 0 for b in blk):
            raise _fail("geometry", f"Elementwise.block must be 1 to 3 positive ints, got {geom.block!r}")
        if _prod(blk) > 1024:
            raise _fail("geometry", f"Elementwise.block {blk} has {_prod(blk)} threads; a block holds at most 1024")
        if geom.layout == "flat":
            if len(blk) != 1:
                raise _fail("geometry", f"Elementwise(layout='flat') takes a 1-D block, got {blk}")
            grid = (sym.cdiv(sym.Prod(sym.OUTPUT, 0), blk[0]), sym.Const(1), sym.Const(1))
        elif geom.layout == "nd":
            g = [sym.cdiv(sym.Dim(sym.OUTPUT, 0, -(i + 1)), b) for i, b in enumerate(blk)]
            outer = sym.Prod(sym.OUTPUT, 0, tuple(-(i + 1) for i in range(len(blk))))
            if len(blk) == 3:
                g[2] = g[2] * outer
            else:
                g += [sym.Const(1)] * (2 - len(blk)) + [outer]
            grid = tuple(g)
            min_out_rank = len(blk)
        else:
            raise _fail("geometry", f"Elementwise.layout must be 'flat' or 'nd', got {geom.layout!r}")
        block = blk + (1,) * (3 - len(blk))
    elif isinstance(geom, Reduction):
        if not isinstance(geom.block_size, int) or not 0 < geom.block_size <= 1024:
            raise _fail("geometry", f"Reduction.block_size must be an int in 1..1024, got {geom.block_size!r}")
        rdims = tuple(geom.reduce_dims) if isinstance(geom.reduce_dims, (tuple, list)) else (geom.reduce_dims,)
        if not rdims or not all(isinstance(a, int) for a in rdims):
            raise _fail("geometry", f"Reduction.reduce_dims must be a non-empty tuple of ints, got {geom.reduce_dims!r}")
        grid = (sym.Prod(sym.INPUT, 0, rdims), sym.Const(1), sym.Const(1))
        block = (geom.block_size, 1, 1)
    elif isinstance(geom, Custom):
        grid, block, shared_mem = _custom_geometry(geom, len(tensor_decls), max(n_outputs, 1))
    else:
        raise _fail("geometry", f"expected Elementwise, Reduction or Custom, got {geom!r}")
    if (isinstance(geom, Elementwise)) and not outputs and not has_meta_fn:
        raise _fail("outputs", "Elementwise geometry is laid over output 0; declare it")

    params = []
    for i, d in enumerate(inputs):
        if isinstance(d, InputDecl):
            params.append(Param("pointer", "input", f"input {d.name!r}", d.name))
        else:
            params.append(Param(SCALAR_KINDS[d.py_type], "scalar", f"scalar {d.name!r} ({d.py_type.__name__})", d.name))
    for e in spec.extras or ():
        axis = f", {e.axis}" if isinstance(e, DimSize) else ""
        params.append(Param("i32", "extra", f"extra {type(e).__name__}({e.input_name!r}{axis})"))
    if schema is not None:
        _check_schema(schema, inputs, n_outputs=len(outputs) or None)
    if not out_names and schema is not None:
        out_names = [f"out{j}" for j in range(_schema_outputs(schema))]
    for name in out_names:
        params.append(Param("pointer", "output", f"output {name!r}", name))

    if schema is None:
        if not outputs:
            raise _fail("outputs", "with no OutputDecl, pass schema= (the outputs are not known)")
        args = ", ".join(
            f"Tensor {d.name}" if isinstance(d, InputDecl) else f"{SCHEMA_TYPES[d.py_type]} {d.name}"
            for d in inputs
        )
        ret = "Tensor" if n_outputs == 1 else "(" + ", ".join(["Tensor"] * n_outputs) + ")"
        schema = f"({args}) -> {ret}"

    if kind == "__global__":
        _check_declared_parameters(spec.kernel_name, code, params, _pointer_dtypes(
            inputs, len(spec.extras or ()), dtypes, out_dtype_from if outputs and not has_meta_fn else None,
            tensor_decls, len(out_names)))

    return KernelPlan(
        spec=spec,
        input_ranks=_input_ranks(len(tensor_decls), params, extras, grid, shared_mem, out_shapes if outputs else (),
                                 _geometry_label(geom)),
        inputs=inputs,
        tensor_positions=tensor_positions,
        tensor_decls=tensor_decls,
        output_names=tuple(out_names),
        output_shapes=tuple(out_shapes) if outputs else None,
        output_dtype_from=tuple(out_dtype_from),
        extras=tuple(extras),
        grid=grid,
        block=block,
        shared_mem=shared_mem,
        min_out_rank=min_out_rank,
        elementwise=isinstance(geom, Elementwise),
        dtypes=dtypes,
        params=tuple(params),
        schema=schema,
    )


def _parse_schema(schema: str) -> Any:
    try:
        return torch._C.parse_schema(f"op{schema}")
    except RuntimeError as exc:
        raise SpecError(f"schema {schema!r} does not parse: {exc}") from exc


def _schema_outputs(schema: str) -> int:
    parsed = _parse_schema(schema)
    if not all(str(r.type) == "Tensor" for r in parsed.returns):
        raise SpecError(f"schema {schema!r}: an fxkern op returns Tensors only")
    return len(parsed.returns)


_SCHEMA_SCALARS = {float: "float", int: "int", bool: "bool"}


def _check_schema(schema: str, inputs: Sequence[Any], n_outputs: Optional[int]) -> None:
    """A ``schema=`` given with the spec: its arguments the spec's inputs in order (a Tensor for each
    InputDecl, the ScalarInput's type for each scalar) and as many Tensors returned as the spec declares
    outputs. A mismatch passed registration and export, then failed at launch with an IndexError."""
    parsed = _parse_schema(schema)
    args = list(parsed.arguments)
    if len(args) != len(inputs):
        raise SpecError(f"schema {schema!r} has {len(args)} arguments, the spec {len(inputs)} inputs "
                        f"({', '.join(d.name for d in inputs)}); give the schema one argument per input, in order")
    for a, d in zip(args, inputs):
        want = "Tensor" if isinstance(d, InputDecl) else _SCHEMA_SCALARS.get(d.py_type, "?")
        if str(a.type) != want:
            raise SpecError(f"schema {schema!r}: argument {a.name!r} is {a.type}, but the spec's input {d.name!r} "
                            f"at that place is a {want}; match the schema to KernelSpec.inputs")
    if n_outputs is not None and len(parsed.returns) != n_outputs:
        raise SpecError(f"schema {schema!r} returns {len(parsed.returns)} tensors, the spec declares {n_outputs} "
                        f"outputs; return one Tensor per OutputDecl")


def _rank_needed(axis: int) -> int:
    return axis + 1 if axis >= 0 else -axis


def _axes_read(expr: sym.Expr):
    """``(kind, index, rank needed)`` for every axis an expression reads."""
    if isinstance(expr, sym.Dim):
        yield expr.kind, expr.index, _rank_needed(expr.axis)
    elif isinstance(expr, sym.Prod):
        for axis in expr.skip:
            yield expr.kind, expr.index, _rank_needed(axis)
    elif isinstance(expr, sym.BinOp):
        yield from _axes_read(expr.lhs)
        yield from _axes_read(expr.rhs)


def _geometry_label(geom: Any) -> str:
    if isinstance(geom, Elementwise) and geom.layout == "nd":
        return f"the 'nd' launch, which tiles the output's last {len(tuple(geom.block))} axes,"
    if isinstance(geom, Reduction):
        return f"Reduction(reduce_dims={tuple(geom.reduce_dims) if isinstance(geom.reduce_dims, (tuple, list)) else geom.reduce_dims})"
    return "the launch geometry"


def _input_ranks(n_tensors: int, params: Sequence[Param], extras: Sequence[sym.Expr], grid: Any,
                 shared_mem: sym.Expr, out_shapes: Sequence[sym.ShapeExpr],
                 geometry: str) -> Tuple[Optional[Tuple[int, str]], ...]:
    """The rank each tensor input needs for the axes the extras, output shapes and geometry read, with
    what reads it, so that a call with too few axes (a 0-d tensor) is refused naming the input, where it
    failed with an IndexError about "input 0". An output's axes are its input's (SameAs) or, for
    ReduceDims, the reduced input's, so the geometry's reads of output axes count there too."""
    need: list = [None] * n_tensors

    def add(index: int, rank: int, what: str) -> None:
        if need[index] is None or rank > need[index][0]:
            need[index] = (rank, what)

    for expr in (*(grid or ()), shared_mem):  # first: where several read as many axes, the geometry is named
        for kind, index, rank in _axes_read(expr):
            if kind == sym.INPUT:
                add(index, rank, geometry)
            elif index < len(out_shapes) and isinstance(out_shapes[index], (sym.ShapeOf, sym.Reduced)):
                shape = out_shapes[index]
                kept = 0 if isinstance(shape, sym.ShapeOf) or shape.keepdim else len(shape.dims)
                add(shape.index, rank + kept, geometry)
    extra_labels = [p.label for p in params if p.role == "extra"]
    for expr, label in zip(extras, extra_labels):
        for _, index, rank in _axes_read(expr):
            add(index, rank, label)
    for j, shape in enumerate(out_shapes):
        if isinstance(shape, sym.Reduced):
            add(shape.index, max(_rank_needed(a) for a in shape.dims), f"output {j}'s ReduceDims{shape.dims}")
    return tuple(need)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _custom_geometry(geom: Custom, n_inputs: int, n_outputs: int):
    if not callable(geom.fn):
        raise _fail("geometry", "Custom.fn must be callable")
    ins = [sym.Shape(sym.INPUT, i) for i in range(n_inputs)]
    outs = [sym.Shape(sym.OUTPUT, j) for j in range(n_outputs)]
    try:
        result = geom.fn(ins, outs)
    except TypeError as exc:
        raise _fail("geometry", f"Custom.fn(inputs, outputs) failed on symbolic shapes: {exc} (sizes are symbols "
                                f"here: build the grid with + * // and fxkern.cdiv, without branching on a size)") from exc
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise _fail("geometry", "Custom.fn must return (grid, block) or (grid, block, shared_mem)")
    grid, block = result[0], result[1]
    shared = result[2] if len(result) == 3 else 0
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
    if not 1 <= len(grid) <= 3 or not 1 <= len(block) <= 3:
        raise _fail("geometry", "Custom.fn: grid and block take 1 to 3 entries")
    if not all(isinstance(b, int) and b > 0 for b in block) or _prod(block) > 1024:
        raise _fail("geometry", f"Custom.fn: block must be positive ints, at most 1024 threads; got {block}")
    try:
        grid = tuple(sym.lift(g) for g in grid) + (sym.Const(1),) * (3 - len(grid))
        shared = sym.lift(shared)
    except TypeError as exc:
        raise _fail("geometry", f"Custom.fn: {exc}") from exc
    if any(isinstance(g, sym.Const) and g.value < 1 for g in grid):
        raise _fail("geometry", f"Custom.fn: a grid entry is a constant under 1 ({result[0]!r}), so no block would "
                                f"ever run; give at least 1 block on each axis")
    return grid, tuple(block) + (1,) * (3 - len(block)), shared
