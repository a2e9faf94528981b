"""Loads compiled kernels onto devices and launches them on torch's stream.

Modules are loaded lazily, once per device, at the first launch there (the
CUBIN is compiled for that device's architecture, through the cache). A
launch packs the arguments into a reusable buffer and calls ``cuLaunchKernel`` on the
current torch stream of the tensors' device: no synchronisation and no
allocation outside torch's allocator, so launches are CUDA-graph capturable.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, Callable, Dict, Sequence, Tuple, Union

import torch

from fxkern.errors import LaunchError

_driver_ready = False


def _driver():
    global _driver_ready
    from cuda.bindings import driver

    if not _driver_ready:
        (err,) = driver.cuInit(0)
        _check(err, "cuInit")
        _driver_ready = True
    return driver


def _check(err: Any, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if name else str(err)
        text = text.decode() if text else ""
        hint = ""
        if name == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION":
            hint = " (the PTX is newer than this driver accepts: compile for this GPU's arch, or update the driver)"
        raise LaunchError(f"{what} failed: {name}: {text}{hint}")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_device() -> int:
    """torch's current CUDA device index, without the Python wrapper's lazy-init checks."""
    return _get_device() if _get_device is not None else torch.cuda.current_device()


def current_stream_handle(device_index: int) -> int:
    """The raw cudaStream_t torch is using on ``device_index`` (no Stream object is built)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class DeviceFunctions:
    """Kernel handles of one compiled module, loaded per device on first use.

    ``load(device_index)`` returns ``{entry name: CUfunction}``; ``image_for``
    gives the bytes to load for a device (CUBIN for its arch, or PTX).
    """

    def __init__(self, image_for: Callable[[int], bytes], entries: Union[Sequence[str], Callable[[], Sequence[str]]]):
        self._image_for = image_for
        self._entries = entries  # or a function giving them, read on first load
        self._loaded: Dict[int, Dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._modules = []

    def load(self, device_index: int) -> Dict[str, Any]:
        functions = self._loaded.get(device_index)
        if functions is not None:
            return functions
        with self._lock:
            if device_index in self._loaded:
                return self._loaded[device_index]
            driver = _driver()
            image = self._image_for(device_index)
            err, dev = driver.cuDeviceGet(device_index)
            _check(err, f"cuDeviceGet({device_index})")
            err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
            _check(err, "cuDevicePrimaryCtxRetain")
            (err,) = driver.cuCtxPushCurrent(ctx)
            _check(err, "cuCtxPushCurrent")
            try:
                # A NUL-terminated copy: PTX must end in NUL, and an address works on every cuda-bindings.
                buffer = ctypes.create_string_buffer(image)
                err, module = driver.cuModuleLoadData(ctypes.addressof(buffer))
                _check(err, f"loading the kernel module on cuda:{device_index}")
                functions = {}
                for name in (self._entries() if callable(self._entries) else self._entries):
                    err, fn = driver.cuModuleGetFunction(module, name.encode())
                    _check(err, f"cuModuleGetFunction({name!r})")
                    functions[name] = fn
            finally:
                driver.cuCtxPopCurrent()
            self._modules.append(module)
            self._loaded[device_index] = functions
            return functions


# struct format and alignment of each parameter kind, as the kernel ABI lays them out.
_LAYOUT = {"pointer": ("Q", 8), "i32": ("i", 4), "f32": ("f", 4), "bool": ("?", 1)}


class KernelLauncher:
    """Launches kernels of one parameter signature.

    ``kinds`` (pointer, i32, f32, bool) fix the layout of one argument
    buffer per thread; a launch packs the values into it with one
    ``struct.pack_into`` and hands the driver pointers into it (the driver
    copies the arguments before ``cuLaunchKernel`` returns).
    """

    def __init__(self, kinds: Sequence[str]):
        fmt, offsets, size = "<", [], 0
        for kind in kinds:
            code, align = _LAYOUT[kind]
            pad = -size % align
            fmt += "x" * pad + code
            size += pad
            offsets.append(size)
            size += align
        self._struct = struct.Struct(fmt)
        self._offsets = offsets
        self._size = max(size, 8)
        self._local = threading.local()

    def _buffers(self):
        buf = ctypes.create_string_buffer(self._size)
        base = ctypes.addressof(buf)
        argv = (ctypes.c_void_p * max(1, len(self._offsets)))(*[base + off for off in self._offsets])
        self._local.pack = pack = (buf, ctypes.addressof(argv), argv)
        return pack

    def __call__(self, function: Any, grid: Tuple[int, int, int], block: Tuple[int, int, int],
                 shared_mem: int, stream: int, values: Sequence[Any], what: str, device: int = -1) -> None:
        """Launch ``function`` on ``stream`` of cuda:``device`` (its index: where the calling thread has
        no CUDA context yet, the device's primary context is made current and the launch retried)."""
        if shared_mem and _shared_mem_allowed.get(int(function), 0) < shared_mem:
            allow_shared_mem(function, shared_mem, what, device)
        pack = getattr(self._local, "pack", None) or self._buffers()
        self._struct.pack_into(pack[0], 0, *values)
        stream_obj = _streams.get(stream) or _stream(stream)
        (err,) = _cuLaunchKernel(
            function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem, stream_obj, pack[1], 0
        )
        if err != _SUCCESS:
            if bind_context(err, device):
                (err,) = _cuLaunchKernel(
                    function, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared_mem, stream_obj, pack[1], 0
                )
                if err == _SUCCESS:
                    return
            _check(err, f"launching {what} with grid {tuple(grid)} and block {tuple(block)}")


def bind_context(err: Any, device: int) -> bool:
    """After ``err`` from a driver call on cuda:``device``: where it is CUDA_ERROR_INVALID_CONTEXT and
    the calling thread has no current context, make the device's primary context (torch's) current and
    say so, for the caller to retry. A thread that has made no CUDA runtime call has none: a new Python
    thread, or autograd's backward threads, whose first CUDA call may be an fxkern launch (the driver
    API, unlike the runtime's, binds no context by itself). Not on the launch path: only after an error."""
    driver = _driver()
    if device < 0 or err != driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        return False
    err, ctx = driver.cuCtxGetCurrent()
    if err != driver.CUresult.CUDA_SUCCESS or int(ctx) != 0:
        return False  # a context is current: the error was about something else
    err, dev = driver.cuDeviceGet(device)
    _check(err, f"cuDeviceGet({device})")
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)  # held for the process, as torch holds it
    _check(err, "cuDevicePrimaryCtxRetain")
    (err,) = driver.cuCtxSetCurrent(ctx)
    _check(err, "cuCtxSetCurrent")
    return True


# A block gets 48 KB of shared memory, static and dynamic together, without asking; more needs the
# function's dynamic limit raised first, up to the device's opt-in maximum (227 KB on Hopper). A
# launch that asks for dynamic shared memory raises it once per function and size.
_shared_mem_allowed: Dict[int, int] = {}


def allow_shared_mem(function: Any, nbytes: int, what: str, device: int = -1) -> None:
    """Raise ``function``'s dynamic shared-memory limit to ``nbytes`` (once per function and size), or
    say what the device allows (cuda:``device``, whose context is made current where the thread has none)."""
    driver = _driver()
    attr = driver.CUfunction_attribute
    (err,) = driver.cuFuncSetAttribute(function, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    if bind_context(err, device):
        (err,) = driver.cuFuncSetAttribute(function, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, static = driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
        _, dev = driver.cuCtxGetDevice()
        _, optin = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        raise LaunchError(
            f"{what} asks for {nbytes} bytes of dynamic shared memory; with its {static} bytes of static "
            f"shared memory this GPU allows at most {optin - static} a block: lower the geometry's shared_mem")
    _shared_mem_allowed[int(function)] = nbytes


_streams: Dict[int, Any] = {}
_cuLaunchKernel = None
_SUCCESS = None


def _stream(handle: int) -> Any:
    """A cuda.bindings CUstream for a raw handle, made once per handle (measured: the Cython
    cuLaunchKernel with prebuilt handle objects is the cheapest Python launch, about 3.6 us)."""
    global _cuLaunchKernel, _SUCCESS
    driver = _driver()
    _cuLaunchKernel, _SUCCESS = driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS
    if len(_streams) > 4096:  # streams come and go; keep the table small
        _streams.clear()
    _streams[handle] = obj = driver.CUstream(handle)
    return obj
