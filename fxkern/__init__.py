"""fxkern: hand-written CUDA kernels as torch custom ops, carried through
torch.export, torch.compile and Torch-TensorRT.

Pipeline, one module per stage: :mod:`spec` (the DSL) → :mod:`derive`
(plan: calling convention, shapes, geometry) → :mod:`compiler` (NVRTC,
cache, signature check) → :mod:`ops` (torch.library registration) →
:mod:`launcher` (per-device load, launch on torch's stream), with
:mod:`split` cutting calls past a kernel's 32-bit sizes into launches within them. Sizes,
extras and grids are :mod:`symbolic` expressions evaluated by interpreters.
Rules: :mod:`patterns` → :mod:`matcher` → :mod:`rewrite` (with :mod:`region`,
and :mod:`views` moved where they hide a match, then matched again);
then :mod:`backends` (torch.compile) and :mod:`tensorrt` (Torch-TensorRT).
"""

from fxkern.errors import (
    CompileError,
    FxkernError,
    KernelInputError,
    LaunchError,
    RegistrationError,
    SignatureMismatch,
    SizeLimitError,
    SpecError,
    TensorRTUnavailable,
)
from fxkern.ops import cuda_kernel_op, kernel_op, ptx_op, registered_ops
from fxkern.backends.torch_compile import backend
from fxkern.region import region
from fxkern.rewrite import Report, VerificationError, apply, explain
from fxkern.rules import Rule, RuleSet, default_rules, replace, rule
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
from fxkern.symbolic import cdiv
from fxkern import tensorrt

tensorrt.install()  # Torch-TensorRT gets fxkern's pass and converters, whichever is imported first

__version__ = "0.1.0"

__all__ = [
    "CompileError",
    "Report",
    "Rule",
    "RuleSet",
    "VerificationError",
    "apply",
    "backend",
    "default_rules",
    "explain",
    "replace",
    "rule",
    "Custom",
    "DimSize",
    "Elementwise",
    "FxkernError",
    "InputDecl",
    "KernelInputError",
    "KernelSpec",
    "LaunchError",
    "Numel",
    "OutputDecl",
    "ReduceDims",
    "Reduction",
    "RegistrationError",
    "SameAs",
    "ScalarInput",
    "SignatureMismatch",
    "SizeLimitError",
    "SpecError",
    "TensorRTUnavailable",
    "cdiv",
    "cuda_kernel_op",
    "kernel_op",
    "ptx_op",
    "region",
    "registered_ops",
    "tensorrt",
]
