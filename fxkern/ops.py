"""Registration: a KernelSpec (or PTX) becomes a torch custom op.

``cuda_kernel_op`` derives the plan, compiles and checks the kernel (no GPU
needed), then defines ``ns::name`` through ``torch.library`` with:

* a CUDA impl that checks the call, allocates outputs with torch and
  launches on the current stream of the inputs' device;
* a fake impl that derives output shapes from the same expressions, with
  SymInts under dynamic shapes;
* a CPU impl that runs ``reference`` (the op's definition in PyTorch), or
  a clear error when there is none.

Every registered op is kept in a registry (:func:`kernel_op`) that the
rewrite pass and the TensorRT converter read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import types
from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fxkern import compiler, launcher, split, symbolic, validate
from fxkern.derive import KernelPlan, plan_kernel
from fxkern.errors import KernelInputError, RegistrationError, SizeLimitError, SpecError
from fxkern.spec import Custom, KernelSpec, ScalarInput

log = logging.getLogger("fxkern")

_PREAMBLE_HEADERS = {torch.float16: "cuda_fp16.h", torch.bfloat16: "cuda_bf16.h"}


@dataclass
class KernelOp:
    """What fxkern knows about one registered op."""

    qualname: str
    schema: str
    spec: Optional[KernelSpec]
    plan: Optional[KernelPlan]
    # The compile for the registration arch (PTX for TensorRT), a future: it may still be running
    # in ``compiler.concurrently`` when the op is registered. ``compiled`` waits for it.
    compile_result: Optional["Future[compiler.CompiledKernel]"]
    source: str  # the source handed to NVRTC (preamble included)
    meta_fn: Optional[Callable[..., Any]]
    eager_fn: Optional[Callable[..., Any]]
    aot_fn: Optional[Callable[..., Any]]
    reference: Optional[Callable[..., Any]]
    supports_dynamic_shapes: bool
    library: torch.library.Library
    identity: Any = field(repr=False, default=None)
    ptx: Optional[str] = None  # ptx_op's own PTX
    ptx_kernel: Optional[str] = None  # ptx_op's .entry name
    cuda_impl: Optional[Callable[..., Any]] = field(repr=False, default=None)
    # the registered fake impl (meta_fn, or the one derived from the spec): what a wrapping op's
    # meta_fn builds on
    fake_impl: Optional[Callable[..., Any]] = field(repr=False, default=None)

    compile_fn: Optional[Callable[[], compiler.CompiledKernel]] = field(repr=False, default=None)
    # the kernel writes each output in the layout meta_fn gives it, not row-major
    strided_outputs: bool = False
    # "reference": a CUDA call past the kernel's 32-bit sizes runs ``reference`` instead of raising;
    # "split": it runs as several calls within them (``split``), the reference where it cannot be cut
    past_limits: str = "raise"

    @property
    def compiled(self) -> Optional[compiler.CompiledKernel]:
        """The compiled kernel; raises the compile's error if it failed."""
        return None if self.compile_result is None else self.compile_result.result()

    def retry_failed_compile(self) -> None:
        """Start the compile again if it failed (registering the same op again retries it)."""
        done = self.compile_result
        if done is not None and done.done() and done.exception() is not None and self.compile_fn is not None:
            self.compile_result = compiler.later(self.compile_fn)

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        ns, name = self.qualname.split("::")
        return getattr(getattr(torch.ops, ns), name)


_REGISTRY: Dict[str, KernelOp] = {}
_LISTENERS: List[Callable[[KernelOp], None]] = []


def kernel_op(qualname: str) -> KernelOp:
    """The registry entry of an fxkern op, by ``ns::name``."""
    try:
        return _REGISTRY[qualname]
    except KeyError:
        raise RegistrationError(f"{qualname!r} is not an fxkern op; registered: {sorted(_REGISTRY)}") from None


def registered_ops() -> List[KernelOp]:
    return list(_REGISTRY.values())


def on_register(callback: Callable[[KernelOp], None]) -> None:
    """Call ``callback(entry)`` for every op registered from now on (the TensorRT converters use it)."""
    _LISTENERS.append(callback)


def _publish(entry: KernelOp) -> None:
    _REGISTRY[entry.qualname] = entry
    for cb in _LISTENERS:
        cb(entry)


def registration_arch(spec: Optional[KernelSpec] = None) -> str:
    """Arch the registration-time PTX targets: ``arch_override``, ``$FXKERN_ARCH``, or sm_90.

    Chosen without touching the GPU, so registering an op does no GPU work.
    """
    if spec is not None and spec.arch_override:
        return compiler.normalize_arch(spec.arch_override)
    return compiler.normalize_arch(os.environ.get("FXKERN_ARCH", compiler.DEFAULT_ARCH))


def _split_name(op_name: str) -> Tuple[str, str]:
    m = re.fullmatch(r"([A-Za-z_]\w*)::([A-Za-z_]\w*)", op_name or "")
    if not m:
        raise RegistrationError(f"op name {op_name!r} must look like 'namespace::name' (identifiers)")
    ns, name = m.groups()
    if ns in ("aten", "prim", "prims", "torch", "_", "fxkern_internal"):
        raise RegistrationError(f"op namespace {ns!r} is reserved; pick your own")
    return ns, name


def kernel_source(spec: KernelSpec) -> str:
    """The source NVRTC compiles: fp16/bf16 headers for the declared dtypes, then the user's code.

    A ``#line`` directive keeps NVRTC's line numbers those of the user's source.
    """
    headers = [_PREAMBLE_HEADERS[d] for d in (spec.dtypes or ()) if d in _PREAMBLE_HEADERS]
    if not headers:
        return spec.kernel_source
    pre = "".join(f"#include <{h}>\n" for h in headers)
    return f'{pre}#line 1 "{spec.kernel_name}.cu"\n{spec.kernel_source}'


def compile_plan(plan: KernelPlan, source: str, arch: str,
                 extra_options: Sequence[str] = ()) -> compiler.CompiledKernel:
    """Compile for ``arch`` and check every instantiation's PTX parameters against the plan.
    ``extra_options``: more NVRTC options (compiler.compile_source), as tools/kernel_resources.py passes."""
    spec = plan.spec
    compiled = compiler.compile_source(
        source,
        plan.name_expressions(),
        arch=arch,
        std=spec.compile_std,
        include_paths=tuple(spec.include_paths or ()),
        filename=f"{spec.kernel_name}.cu",
        extra_options=extra_options,
    )
    entries = compiler.ptx_entries(compiled.ptx)
    for expr in plan.name_expressions():
        entry = compiled.entry(expr)
        if entry not in entries:
            raise SpecError(f"kernel {expr!r} is not a __global__ function in the compiled PTX")
        compiler.check_signature(expr, entries[entry], plan.params)
    return compiled


def cuda_kernel_op(
    op_name: str,
    spec: KernelSpec,
    *,
    meta_fn: Optional[Callable[..., Any]] = None,
    eager_fn: Optional[Callable[..., Any]] = None,
    aot_fn: Optional[Callable[..., Any]] = None,
    schema: Optional[str] = None,
    reference: Optional[Callable[..., Any]] = None,
    supports_dynamic_shapes: bool = True,
    strided_outputs: bool = False,
    past_limits: str = "raise",
) -> torch._ops.OpOverloadPacket:
    """Register ``spec`` as the torch op ``op_name`` (``ns::name``) and return it.

    ``meta_fn``/``eager_fn``/``aot_fn``/``schema`` replace what would be
    derived from the spec; ``reference`` is the op in PyTorch (its CPU impl
    and the oracle for checks). Registering the same name with an equal spec
    again returns the existing op.

    The derived launch hands the kernel row-major outputs. Where ``meta_fn``
    lays an output out otherwise, the result is copied into that layout,
    unless ``strided_outputs=True`` says the kernel writes the layout itself.

    A CUDA call whose sizes are past what the kernel indexes (32-bit ints, CUDA's grid) raises
    :class:`SizeLimitError`; with ``past_limits="reference"`` it runs ``reference`` on the GPU
    instead (PyTorch's own kernels, slower but right), saying so once. The library's ops do: a
    rewritten model must run every size the original ran. ``past_limits="split"`` promises more: the
    op's outputs are independent problems along every axis but the last (:mod:`fxkern.split`), so
    such a call runs as several launches of the kernel within the limits (:func:`fxkern.split.plan`
    says where it is cut), and the reference only where it cannot be cut (a single row past the limits).
    """
    if past_limits not in ("raise", "reference", "split"):
        raise SpecError(f"{op_name}: past_limits= must be 'raise', 'reference' or 'split', got {past_limits!r}")
    if past_limits != "raise" and reference is None:
        raise SpecError(f"{op_name}: past_limits={past_limits!r} needs reference= (the op in PyTorch) to run")
    for what, fn in (("meta_fn", meta_fn), ("eager_fn", eager_fn), ("aot_fn", aot_fn), ("reference", reference)):
        if fn is not None and not callable(fn):
            raise SpecError(f"{op_name}: {what}= must be a function of the op's arguments, got {fn!r}")
    ns, name = _split_name(op_name)
    identity = (_spec_id(spec), schema, _fn_id(meta_fn), _fn_id(eager_fn), _fn_id(aot_fn), _fn_id(reference),
                bool(strided_outputs), past_limits)
    existing = _existing(op_name, identity)
    if existing is not None:
        return existing
    plan = plan_kernel(spec, has_meta_fn=meta_fn is not None, has_eager_fn=eager_fn is not None, schema=schema)
    source, arch = kernel_source(spec), registration_arch(spec)

    def compile_fn() -> compiler.CompiledKernel:
        return compile_plan(plan, source, arch)

    compiled = compiler.later(compile_fn)
    lib = _define(ns, name, plan.schema)
    entry = KernelOp(
        qualname=op_name, schema=plan.schema, spec=spec, plan=plan, compile_result=compiled, compile_fn=compile_fn,
        source=source,
        meta_fn=meta_fn, eager_fn=eager_fn, aot_fn=aot_fn, reference=reference,
        supports_dynamic_shapes=supports_dynamic_shapes, library=lib, identity=identity,
        strided_outputs=bool(strided_outputs), past_limits=past_limits,
    )
    entry.fake_impl = _checked_meta(entry) if meta_fn is not None else _fake_impl(entry)
    if eager_fn is None:
        entry.cuda_impl = _cuda_impl(entry)  # runs the reference past the limits itself, at no cost a call
    elif past_limits != "raise":
        entry.cuda_impl = _reference_past_limits(entry, eager_fn)
    else:
        entry.cuda_impl = eager_fn
    lib.impl(name, entry.cuda_impl, "CUDA")
    lib.impl(name, _reference_impl(entry), "CPU")
    torch.library.register_fake(op_name, entry.fake_impl, lib=lib)
    _publish(entry)
    log.info("fxkern: registered %s%s", op_name, plan.schema)
    return entry.op


def ptx_op(
    op_name: str,
    ptx: Any,
    kernel_name: str,
    *,
    meta_fn: Callable[..., Any],
    eager_fn: Optional[Callable[..., Any]] = None,
    aot_fn: Optional[Callable[..., Any]] = None,
    schema: Optional[str] = None,
    reference: Optional[Callable[..., Any]] = None,
) -> torch._ops.OpOverloadPacket:
    """Register pre-compiled PTX as the op ``op_name``; NVRTC is skipped.

    With no spec there is no derived launch: ``eager_fn`` runs the op on
    CUDA, ``meta_fn`` gives its output shapes, ``aot_fn`` its TensorRT launch.
    The schema is ``schema`` or inferred from ``meta_fn``'s annotations.
    """
    ns, name = _split_name(op_name)
    text = ptx.decode() if isinstance(ptx, (bytes, bytearray)) else ptx
    if not isinstance(text, str) or ".entry" not in text:
        raise SpecError(f"ptx_op {op_name}: ptx must be PTX text (str or bytes) with a .entry")
    entries = compiler.ptx_entries(text)
    if kernel_name not in entries:
        raise SpecError(f"ptx_op {op_name}: no .entry {kernel_name!r} in the PTX; it has {sorted(entries)}")
    if not callable(meta_fn):
        raise SpecError(f"ptx_op {op_name}: meta_fn is required (it gives the output shapes)")
    if schema is None:
        try:
            schema = torch.library.infer_schema(meta_fn, mutates_args=())
        except ValueError as exc:
            raise SpecError(f"ptx_op {op_name}: pass schema=, or annotate meta_fn's parameters ({exc})") from exc
    identity = (text, kernel_name, schema, _fn_id(meta_fn), _fn_id(eager_fn), _fn_id(aot_fn), _fn_id(reference))
    existing = _existing(op_name, identity)
    if existing is not None:
        return existing
    lib = _define(ns, name, schema)
    entry = KernelOp(
        qualname=op_name, schema=schema, spec=None, plan=None, compile_result=None, source="",
        meta_fn=meta_fn, eager_fn=eager_fn, aot_fn=aot_fn, reference=reference,
        supports_dynamic_shapes=True, library=lib, identity=identity, ptx=text, ptx_kernel=kernel_name,
    )
    if eager_fn is not None:
        lib.impl(name, eager_fn, "CUDA")
    else:
        lib.impl(name, _no_impl(op_name, "CUDA", "pass eager_fn= to run it outside TensorRT"), "CUDA")
    entry.fake_impl = meta_fn
    lib.impl(name, _reference_impl(entry), "CPU")
    torch.library.register_fake(op_name, meta_fn, lib=lib)
    _publish(entry)
    return entry.op


# ---- registration helpers ----------------------------------------------------


def _fn_id(fn: Optional[Callable[..., Any]], depth: int = 0) -> Any:
    """A function as compared for re-registration: its name, its code with the constants in it (``x * 2``
    and ``x * 3`` differ only there), and what its closure holds (numbers, strings and functions, by
    value; other objects by type), so that a changed block size or reference is not taken for the old one."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(_value_id(cell.cell_contents, depth))
        except ValueError:  # an empty cell
            cells.append(None)
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)),
            _code_id(code) if code else None, tuple(cells))


def _code_id(code: types.CodeType) -> Any:
    """Bytecode, the names it loads (``torch.sin`` and ``torch.cos`` differ only there) and its constants."""
    return code.co_code, code.co_names, tuple(_code_id(c) if isinstance(c, types.CodeType) else _value_id(c, 4)
                                              for c in code.co_consts)


def _value_id(value: Any, depth: int) -> Any:
    if isinstance(value, float) and value != value:
        return "nan"  # equal to itself here, unlike NaN
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, tuple):
        return tuple(_value_id(v, depth) for v in value)
    if isinstance(value, (torch.dtype, torch.device)):
        return repr(value)
    if callable(value) and hasattr(value, "__code__"):
        return _fn_id(value, depth + 1) if depth < 4 else getattr(value, "__qualname__", None)
    if callable(value):  # a builtin (torch.mul), by its name
        return getattr(value, "__module__", None), getattr(value, "__qualname__", type(value).__qualname__)
    return type(value).__qualname__


def _spec_id(spec: KernelSpec) -> Any:
    """The spec as compared for re-registration: a Custom geometry function by its code, not its identity."""
    if isinstance(spec, KernelSpec) and isinstance(spec.geometry, Custom):
        return dataclasses.replace(spec, geometry=Custom(_fn_id(spec.geometry.fn)))
    return spec


def _existing(op_name: str, identity: Any) -> Optional[torch._ops.OpOverloadPacket]:
    entry = _REGISTRY.get(op_name)
    if entry is None:
        return None
    if entry.identity == identity:
        log.debug("fxkern: %s already registered with this spec", op_name)
        entry.retry_failed_compile()  # raises here again, outside a concurrently block, if it still fails
        return entry.op
    raise RegistrationError(
        f"op {op_name} is already registered with a different spec or override (meta_fn, eager_fn, aot_fn, "
        f"schema, reference, strided_outputs, past_limits); pick another "
        f"name (the old one stays registered until the process exits)"
    )


def _define(ns: str, name: str, schema: str) -> torch.library.Library:
    namespace = getattr(torch.ops, ns)
    if hasattr(namespace, name):
        raise RegistrationError(f"op {ns}::{name} already exists and is not an fxkern op; pick another name")
    lib = torch.library.Library(ns, "FRAGMENT")
    try:
        lib.define(f"{name}{schema}")
    except RuntimeError as exc:
        raise SpecError(f"op {ns}::{name}: schema {schema!r} is invalid: {exc}") from exc
    return lib


def _no_impl(op_name: str, where: str, hint: str) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        raise KernelInputError(f"{op_name} has no {where} implementation: {hint}")

    return impl


def _as_tuple(result: Any) -> Tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


# ---- impls -------------------------------------------------------------------


def _fake_impl(entry: KernelOp) -> Callable[..., Any]:
    plan, op = entry.plan, entry.qualname
    shape_fns = [symbolic.compile_shape(s) for s in plan.output_shapes]
    positions = plan.tensor_positions
    single = len(shape_fns) == 1
    scalars = _scalar_slots(plan)

    def fake(*args: Any) -> Any:
        tensors = [args[i] for i in positions]
        validate.warn_no_backward(op, tensors)
        validate.check_scalars(op, scalars, args)
        dtype = validate.call_dtype(op, plan, tensors)
        validate.check_ranks(op, plan, tensors)
        env = ([t.shape for t in tensors], ())
        shapes = [f(env) for f in shape_fns]
        validate.check_shapes(op, plan, tensors, shapes[0])
        dtypes = validate.output_dtypes(plan, tensors, dtype)
        device = tensors[0].device
        outs = [tensors[0].new_empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]
        return outs[0] if single else tuple(outs)

    return fake


def _scalar_slots(plan: KernelPlan) -> List[Tuple[int, str, type]]:
    """(position, name, Python type) of each scalar the spec declares."""
    return [(i, d.name, d.py_type) for i, d in enumerate(plan.inputs) if isinstance(d, ScalarInput)]


def _checked_meta(entry: KernelOp) -> Callable[..., Any]:
    """``meta_fn`` behind the spec's dtype check, as the launch checks them: a meta_fn that gave shapes
    only let a rewrite accept matches the kernel then refused at run time (float64 scores, a float32
    LayerNorm weight with bfloat16 activations; found by a probe)."""
    plan, op, meta_fn = entry.plan, entry.qualname, entry.meta_fn
    positions = plan.tensor_positions
    scalars = _scalar_slots(plan)

    def fake(*args: Any) -> Any:
        outs = meta_fn(*args)  # first: its own checks say more than the generic one
        tensors = [args[i] for i in positions]
        validate.call_dtype(op, plan, tensors)
        validate.check_scalars(op, scalars, args)
        validate.warn_no_backward(op, tensors)
        return outs

    return fake


def _on_meta(args: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """``args`` with each tensor a meta tensor of its shape, strides and dtype: what a fake impl reads,
    without allocating outputs on the real device."""
    return tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                 if isinstance(a, torch.Tensor) else a for a in args)


def _reference_impl(entry: KernelOp) -> Callable[..., Any]:
    """The op computed by ``reference``, checked as the launch checks it and laid out as the fake impl
    says (so compiled graphs traced with the fake impl read it right): the CPU impl, and the CUDA
    one past the kernel's limits with ``past_limits="reference"``."""
    op, reference = entry.qualname, entry.reference
    if reference is None:
        return _no_impl(op, "CPU", "move the inputs to a CUDA device, or register it with reference= (a PyTorch function)")
    fake = entry.fake_impl  # set before this is called, by both ways of registering an op
    # the spec's scalars, checked as the CUDA launch checks them (a 2**40 for a 32-bit int went
    # through on the CPU and failed only on a GPU; found by a usability test)
    scalars = _scalar_slots(entry.plan) if entry.plan is not None else []

    def run(*args: Any) -> Any:
        validate.warn_no_backward(op, args)
        validate.check_scalars(op, scalars, args)  # ptx_op's fake impl is its meta_fn alone
        expected = _as_tuple(fake(*_on_meta(args)))  # validates the call like the CUDA path
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        outs = _as_tuple(reference(*args))
        if len(outs) != len(expected):
            raise SpecError(f"{op}: reference returned {len(outs)} outputs, the op declares {len(expected)}")
        fixed = []
        for i, (o, e) in enumerate(zip(outs, expected)):
            if not isinstance(o, torch.Tensor) or o.dtype != e.dtype or o.shape != e.shape:
                got = f"{o.dtype} {tuple(o.shape)}" if isinstance(o, torch.Tensor) else repr(o)
                raise SpecError(
                    f"{op}: reference output {i} is {got}, the op declares {e.dtype} {tuple(e.shape)}"
                )
            # a fresh tensor laid out as the fake impl says, as the CUDA path returns it
            if any(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in inputs) or (
                    o.stride() != e.stride()):
                o = torch.empty_strided(e.shape, e.stride(), dtype=o.dtype, device=o.device).copy_(o)
            fixed.append(o)
        return fixed[0] if len(fixed) == 1 else tuple(fixed)

    return run


def _reference_instead(entry: KernelOp) -> Optional[Callable[[SizeLimitError, Tuple[Any, ...]], Any]]:
    """With ``past_limits="reference"`` or ``"split"``, what a CUDA call past the kernel's limits runs
    instead of raising: the call cut into pieces within them (``"split"``, where it can be cut), else
    the reference on the GPU; each way logged once per op. None where the call raises."""
    if entry.past_limits == "raise":
        return None
    run, warned = _reference_impl(entry), set()

    def instead(error: SizeLimitError, args: Tuple[Any, ...]) -> Any:
        cut = expected = None
        if entry.past_limits == "split":
            whole = entry.fake_impl(*_on_meta(args))
            expected = _as_tuple(whole)
            cut = split.plan([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args],
                             [tuple(e.shape) for e in expected])
        if cut is not None:
            if "split" not in warned:
                warned.add("split")
                log.info("fxkern: %s: %s. Calls past its kernel's limits run as several calls within them "
                         "(this one as %d along axis %d); logged once per op",
                         entry.qualname, error.limit, len(cut.pieces), cut.axis)
            return split.run(entry.cuda_impl, args, cut, expected, single=not isinstance(whole, (tuple, list)),
                             op=entry.qualname)
        if "reference" not in warned:
            warned.add("reference")
            log.warning("fxkern: %s: %s. Calls past its kernel's limits run the op's reference instead "
                        "(PyTorch's own kernels: the same result, at eager speed); logged once per op",
                        entry.qualname, error.limit)
        return run(*args)

    return instead


def _reference_past_limits(entry: KernelOp, eager_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``eager_fn``, with calls it refuses as past its kernels' limits run by the reference."""
    instead = _reference_instead(entry)

    def cuda(*args: Any) -> Any:
        try:
            return eager_fn(*args)
        except SizeLimitError as error:
            refused = error.with_traceback(None)  # its frames held what eager_fn made before it refused
        return instead(refused, args)  # outside the except: nothing of the refused call is kept alive

    cuda.__name__ = getattr(eager_fn, "__name__", "cuda")
    return cuda


# Signatures remembered per op; a model has a handful, a sequence growing one token a call one a call.
MAX_SIGNATURES = 1024


class Signatures(dict):
    """What was decided for each call signature of an op, at most MAX_SIGNATURES of them: shapes that
    never repeat (a growing sequence) start it over rather than grow it without bound."""

    def remember(self, key: Any, value: Any) -> Any:
        if len(self) >= MAX_SIGNATURES:
            self.clear()
        self[key] = value
        return value


def tensor_signature(*tensors: torch.Tensor) -> Tuple[Any, ...]:
    """The part of a call's signature its tensors give: each one's shape, strides, dtype and device."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device) for t in tensors])


def _like(index: int, dtype: Optional[torch.dtype]) -> Callable[[List[torch.Tensor]], torch.Tensor]:
    """An output allocated like input ``index`` (contiguous by then), in ``dtype`` if given."""
    if dtype is None:
        return lambda tensors: torch.empty_like(tensors[index])
    return lambda tensors: torch.empty_like(tensors[index], dtype=dtype)


def _new(shape: Tuple[int, ...], stride: Tuple[int, ...], dtype: torch.dtype, device: torch.device,
         contiguous: bool) -> Callable[[List[torch.Tensor]], torch.Tensor]:
    """An output of a fixed shape, strides and dtype (a derived shape, or a meta_fn's output)."""
    if contiguous:
        return lambda tensors: torch.empty(shape, dtype=dtype, device=device)
    return lambda tensors: torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _cuda_impl(entry: KernelOp) -> Callable[..., Any]:
    """The derived eager launcher: check, allocate, compute geometry, launch."""
    plan, op = entry.plan, entry.qualname
    positions = plan.tensor_positions
    inputs = plan.inputs
    meta_fn = entry.meta_fn
    shape_fns = [symbolic.compile_shape(s) for s in plan.output_shapes] if meta_fn is None else None
    grid_fns = [symbolic.compile_expr(g) for g in plan.grid]
    extra_fns = [symbolic.compile_expr(e) for e in plan.extras]
    smem_fn = symbolic.compile_expr(plan.shared_mem)
    extra_labels = [p.label for p in plan.params if p.role == "extra"]
    output_names = [p.name for p in plan.params if p.role == "output"]
    kinds = [p.kind for p in plan.params]
    block = plan.block
    dtypes = plan.dtypes
    entry_names = {d: plan.name_expression(d) for d in (dtypes or (None,))}
    compiled_by_arch: Dict[str, compiler.CompiledKernel] = {}

    override = compiler.normalize_arch(entry.spec.arch_override) if entry.spec.arch_override else None

    def compiled_for(device_index: int) -> compiler.CompiledKernel:
        arch = compiler.device_arch(override, *torch.cuda.get_device_capability(device_index))
        if arch not in compiled_by_arch:
            compiled_by_arch[arch] = compile_plan(plan, entry.source, arch)
        return compiled_by_arch[arch]

    def lowered(dtype: Optional[torch.dtype]) -> str:
        """A kernel's lowered name, read from the registration compile when first needed (it may
        still be running in ``compiler.concurrently`` when the op is registered)."""
        return entry.compiled.entry(entry_names[dtype])

    functions = launcher.DeviceFunctions(
        lambda idx: compiled_for(idx).cubin,
        lambda: [lowered(d) for d in entry_names],
    )
    scalar_slots = [(i, d.name, d.py_type) for i, d in enumerate(inputs) if i not in positions]
    single = sum(p.role == "output" for p in plan.params) == 1

    launch = launcher.KernelLauncher(kinds)
    strided_outputs, warned = entry.strided_outputs, []
    loaded: Dict[Tuple[int, Any], int] = {}

    def load(index: int, dtype: Optional[torch.dtype]) -> int:
        loaded[(index, dtype)] = fn = functions.load(index)[lowered(dtype if dtypes else None)]
        return fn

    fast_check = validate.fast_checker(plan)
    all_tensors = len(inputs) == len(positions)
    grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad
    # Output shapes that are an input's shape (SameAs) need no evaluation.
    same_as = [s.index if isinstance(s, symbolic.ShapeOf) else None for s in (plan.output_shapes or ())]
    simple_outputs = meta_fn is None and all(i is not None for i in same_as)
    smem_const = plan.shared_mem.value if isinstance(plan.shared_mem, symbolic.Const) else None
    dtype_from = plan.output_dtype_from
    int32_max = validate.INT32_MAX
    instead = _reference_instead(entry)

    grid_const = [g.value if isinstance(g, symbolic.Const) else None for g in plan.grid]
    grid_x = grid_fns[0]
    grid_yz_const = grid_const[1] is not None and grid_const[2] is not None
    gy, gz = grid_const[1], grid_const[2]

    # A call's checks, outputs, grid and extras depend only on its signature: each input's shape, dtype,
    # device and contiguity (with a meta_fn, which may read them, its strides and the scalars too).
    # They are worked out and checked once per signature, as a JIT guards a specialisation, and a
    # model's repeated calls pay only for allocating, packing and launching.
    scalar_positions = tuple(i for i, _, _ in scalar_slots)
    launches = Signatures()

    def signature(args: Tuple[Any, ...], tensors: List[torch.Tensor]) -> Any:
        if meta_fn is None:
            return tuple([(t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors])
        return tensor_signature(*tensors), tuple([args[i] for i in scalar_positions])

    def prepare(args: Tuple[Any, ...], tensors: List[torch.Tensor]) -> Tuple[Tuple[Any, ...], List[torch.Tensor]]:
        """Check a new signature and decide its launch; returns it with this call's outputs."""
        ok, dtype = fast_check(tensors)
        if not ok:
            validate.check_devices(op, plan, tensors)
            dtype = validate.call_dtype(op, plan, tensors)
            validate.check_ranks(op, plan, tensors)
        device = tensors[0].device
        copies = tuple(k for k, t in enumerate(tensors) if not t.is_contiguous())
        for k in copies:
            tensors[k] = tensors[k].contiguous()
        in_shapes = [t.shape for t in tensors]
        relayout = ()
        if simple_outputs and ok:
            allocs = tuple(_like(i, None if src is None and dtype == tensors[i].dtype
                                 else dtype if src is None else tensors[src].dtype)
                           for i, src in zip(same_as, dtype_from))
            outs = [alloc(tensors) for alloc in allocs]
        else:
            if meta_fn is None:
                shapes = [f((in_shapes, ())) for f in shape_fns]
                validate.check_shapes(op, plan, tensors, shapes[0])
                out_dtypes = validate.output_dtypes(plan, tensors, dtype)
                outs = [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, out_dtypes)]
            else:
                outs = list(_as_tuple(meta_fn(*args)))
                if not strided_outputs:  # the kernel writes row-major; the result gets meta_fn's layout after
                    relayout = tuple((k, tuple(o.shape), o.stride(), o.dtype) for k, o in enumerate(outs)
                                     if not o.is_contiguous())
                    if relayout and not warned:
                        warned.append(True)
                        log.warning("fxkern: %s: meta_fn lays out output %d with strides %s; the kernel writes "
                                    "outputs row-major, so each such call copies its result into that layout "
                                    "(register with strided_outputs=True if the kernel writes it itself)",
                                    op, relayout[0][0], relayout[0][2])
                    for k, shape, _, out_dtype in relayout:
                        outs[k] = torch.empty(shape, dtype=out_dtype, device=device)
            allocs = tuple(_new(tuple(o.shape), o.stride(), o.dtype, device, o.is_contiguous()) for o in outs)
        env = (in_shapes, [o.shape for o in outs])
        grid = (grid_x(env), gy, gz) if grid_yz_const else (grid_x(env), grid_fns[1](env), grid_fns[2](env))
        if grid[0] > int32_max or grid[1] > 65535 or grid[2] > 65535:
            validate.check_grid(op, grid)
        if min(grid) <= 0:
            validate.check_no_blocks(op, grid, output_names, outs)
        extras = [f(env) for f in extra_fns]
        if extras and max(extras) > int32_max:
            validate.check_int32(op, extra_labels, extras)
        index = device.index
        fn = smem = None
        if grid[0] and grid[1] and grid[2]:  # an empty input launches nothing (and may size nothing)
            smem = smem_const if smem_const is not None else smem_fn(env)
            fn = loaded.get((index, dtype)) or load(index, dtype)
        described = split.describe(outs) if not relayout else None
        return (copies, allocs, fn, grid, smem, extras, index, relayout, described), outs

    def cuda(*args: Any) -> Any:
        tensors = list(args) if all_tensors else [args[i] for i in positions]
        if grad_enabled() and any_requires_grad(*tensors):
            validate.warn_no_backward(op, tensors)
        key = signature(args, tensors)
        known = launches.get(key)
        if known is None:
            refused = None
            try:
                known, outs = prepare(args, tensors)
            except SizeLimitError as error:  # raised before any launch
                if instead is None:
                    raise
                refused = error.with_traceback(None)  # its frames held the copies and outputs prepare made
            if refused is not None:
                tensors.clear()  # and contiguous copies in here: the reference runs without them
                return instead(refused, args)
            launches.remember(key, known)
            copies, _, fn, grid, smem, extras, index, relayout, _ = known
            if not relayout:
                outs = split.into(outs)  # a piece of a cut call writes its part of the whole call's outputs
        else:
            copies, allocs, fn, grid, smem, extras, index, relayout, described = known
            for k in copies:
                tensors[k] = tensors[k].contiguous()
            # a piece of a cut call writes its part of the whole call's outputs, allocating none
            outs = (described is not None and split.take(described)) or [alloc(tensors) for alloc in allocs]
        if fn is not None:
            if all_tensors:
                values = [t.data_ptr() for t in tensors]
            else:
                values = list(args)
                for i, t in zip(positions, tensors):
                    values[i] = t.data_ptr()
                for i, name, py_type in scalar_slots:
                    values[i] = validate.coerce_scalar(op, name, py_type, args[i])
            values += extras
            for o in outs:
                values.append(o.data_ptr())
            if launcher.current_device() != index:
                with torch.cuda.device(index):
                    launch(fn, grid, block, smem, launcher.current_stream_handle(index), values, op, index)
            else:
                launch(fn, grid, block, smem, launcher.current_stream_handle(index), values, op, index)
        for k, shape, stride, out_dtype in relayout:
            outs[k] = torch.empty_strided(shape, stride, dtype=out_dtype, device=outs[k].device).copy_(outs[k])
        return outs[0] if single else tuple(outs)

    cuda.launch, cuda.functions, cuda.lowered = launch, functions, lowered  # for profiling and tests
    return cuda
