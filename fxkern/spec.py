"""The declarative kernel DSL: plain frozen dataclasses, no logic.

Names and fields follow ``torch_tensorrt.kernels`` so that specs written for
it port by changing the import. What a spec *means* (shapes, extras, launch
geometry, schema) is derived in :mod:`fxkern.derive`; a spec is checked
there, at registration.

Calling convention every kernel follows::

    (tensor input pointers and scalar inputs in declaration order...,
     extras in declaration order..., output pointers...)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union

import torch

# ---- output shapes ---------------------------------------------------------


@dataclass(frozen=True)
class SameAs:
    """The output has the shape of a tensor input (its name, or its index among tensor inputs)."""

    input_idx: Union[int, str] = 0


@dataclass(frozen=True)
class ReduceDims:
    """The output is a tensor input's shape with ``dims`` removed (kept as 1 with ``keepdim``)."""

    input_idx: Union[int, str]
    dims: Tuple[int, ...]
    keepdim: bool = False


ShapeRel = Union[SameAs, ReduceDims]

# ---- extras: int32 arguments between the inputs and the outputs ------------


@dataclass(frozen=True)
class Numel:
    """Pass the element count of a tensor input as an ``int``."""

    input_name: str


@dataclass(frozen=True)
class DimSize:
    """Pass one dimension of a tensor input as an ``int`` (negative axes allowed)."""

    input_name: str
    axis: int


ExtraArg = Union[Numel, DimSize]

# ---- launch geometry -------------------------------------------------------


@dataclass(frozen=True)
class Elementwise:
    """One thread per output element of output 0.

    ``layout="flat"``: ``grid_x = cdiv(numel(out0), block[0])``.
    ``layout="nd"``: ``block[i]`` tiles output axis ``-(i+1)``; the axes in
    front of the tiled ones are folded into ``grid_z``.
    """

    block: Tuple[int, ...] = (256,)
    layout: Literal["flat", "nd"] = "flat"


@dataclass(frozen=True)
class Reduction:
    """One block per row: ``grid_x`` is the product of input 0's axes not in ``reduce_dims``."""

    reduce_dims: Tuple[int, ...]
    block_size: int = 256


@dataclass(frozen=True)
class Custom:
    """Launch geometry written as a function of symbolic shapes.

    ``fn(inputs, outputs)`` receives one :class:`fxkern.symbolic.Shape` per
    tensor input and per output and returns ``(grid, block)`` or
    ``(grid, block, shared_mem)``. ``grid`` entries are expressions built
    from those shapes (``inputs[0][-1]``, ``outputs[0].numel()``, ``cdiv``,
    ``+``, ``*``, ``//``) or ints; ``block`` entries are ints. The same
    expressions drive the eager launch, fake shapes and the TensorRT plugin.
    """

    fn: Callable[..., Any]


Geometry = Union[Elementwise, Reduction, Custom]

# ---- inputs and outputs ----------------------------------------------------


@dataclass(frozen=True)
class InputDecl:
    """A tensor input, passed to the kernel as a pointer to contiguous data.

    ``dtype`` pins its element type; without it the input follows the call's
    dtype (see ``KernelSpec.dtypes``). ``broadcast=True`` lets an input of an
    ``Elementwise`` kernel have any shape that broadcasts to the output's.
    """

    name: str
    dtype: Optional[torch.dtype] = None
    broadcast: bool = False


@dataclass(frozen=True)
class ScalarInput:
    """A scalar passed by value: ``float`` as f32, ``int`` as int32, ``bool`` as bool."""

    name: str
    py_type: type


InputSpec = Union[InputDecl, ScalarInput]


@dataclass(frozen=True)
class OutputDecl:
    """An output tensor; its dtype is ``dtype_from``'s (a tensor input name) or the call's dtype (where
    every tensor input pins its dtype, there is none: the dtype of the input the output is shaped like)."""

    name: str
    shape: ShapeRel
    dtype_from: Optional[str] = None


# ---- the spec --------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """A CUDA C++ kernel and what it takes and returns.

    ``dtypes``: element types a kernel written as ``template <typename T>``
    is instantiated for (``float``, ``__half``, ``__nv_bfloat16``...). With
    no ``dtypes`` and no ``InputDecl.dtype``, tensor inputs must be float32.
    """

    kernel_source: str
    kernel_name: str
    inputs: Optional[Sequence[InputSpec]] = None
    outputs: Optional[Sequence[OutputDecl]] = None
    extras: Sequence[ExtraArg] = ()
    geometry: Optional[Geometry] = None
    include_paths: Optional[Sequence[str]] = None
    compile_std: str = "c++17"
    arch_override: Optional[str] = None
    dtypes: Optional[Sequence[torch.dtype]] = field(default=None)
