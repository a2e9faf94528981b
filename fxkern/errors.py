"""fxkern's exception types.

Every error a user can trigger is one of these, with a message that says
what to change. They subclass the built-in type a caller would otherwise
expect (``ValueError``, ``TypeError``, ``RuntimeError``), so existing
``except`` clauses keep working.
"""


class FxkernError(Exception):
    """Base class of every fxkern error."""


class SpecError(FxkernError, ValueError):
    """A KernelSpec (or an override passed with it) is malformed."""


class CompileError(FxkernError, RuntimeError):
    """NVRTC rejected the kernel source; the message carries its log."""


class SignatureMismatch(FxkernError, TypeError):
    """The kernel's parameter list disagrees with the spec's calling convention."""


class RegistrationError(FxkernError, RuntimeError):
    """An op name is taken by a different spec, or is not a valid name."""


class KernelInputError(FxkernError, ValueError):
    """A call passed tensors or scalars the kernel cannot take (device, dtype, shape, size)."""


class SizeLimitError(KernelInputError):
    """A call's sizes are past what the kernel indexes (32-bit ints, CUDA's grid), though eager PyTorch
    would run it. An op registered with ``past_limits="reference"`` runs its reference instead.
    ``limit`` is the fact without the advice ("extra Numel('x') is 2147483648, past the 32-bit int
    the kernel takes"), for the warning such an op logs."""

    def __init__(self, message: str, limit: str = ""):
        super().__init__(message)
        self.limit = limit or message


class LaunchError(FxkernError, RuntimeError):
    """The CUDA driver refused to load or launch the kernel."""


class TensorRTUnavailable(FxkernError, RuntimeError):
    """Torch-TensorRT, or its plugin support, is not usable here; the message says which versions work."""
