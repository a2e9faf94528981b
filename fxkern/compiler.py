"""NVRTC compilation, the on-disk cache, and the kernel signature check.

Compilation uses the low-level ``cuda.bindings.nvrtc`` API so it runs on a
machine with no GPU and no driver. One compile per (source, arch) yields
PTX (handed to TensorRT, and checked here) and CUBIN (loaded for eager
launches), with every dtype instantiation of a templated kernel in it.

The cache key covers everything that changes the output: source, name
expressions, options, arch and NVRTC version. Entries are written
atomically and carry a digest, so a torn or corrupt entry is recompiled;
a file lock per key makes processes that start cold compile once.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

from filelock import FileLock

from fxkern.errors import CompileError, SignatureMismatch

log = logging.getLogger("fxkern")

CACHE_FORMAT = "fxkern-cache-1"
DEFAULT_ARCH = "sm_90"

# Counters for tests and the benchmark: how often we compiled vs hit the cache.
stats = {"compiles": 0, "hits": 0}
_stats_lock = threading.Lock()
T = TypeVar("T")


@dataclass(frozen=True)
class CompiledKernel:
    """Output of one NVRTC compile."""

    arch: str
    ptx: str
    cubin: bytes
    lowered: Dict[str, str]  # name expression -> PTX entry name
    log: str

    def entry(self, name_expression: str) -> str:
        return self.lowered[name_expression]


@dataclass(frozen=True)
class PtxParam:
    """One ``.param`` of a PTX ``.entry``: its type (``u64``, ``f32``...) and byte size."""

    ptx_type: str
    size: int


def cache_dir() -> Path:
    if os.environ.get("FXKERN_CACHE_DIR"):
        return Path(os.environ["FXKERN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxkern"


def default_include_paths() -> Tuple[str, ...]:
    """CUDA's own headers (``cuda_fp16.h``, ``cuda_bf16.h``...), found by cuda.pathfinder.

    NVRTC ships no such headers; the ``nvidia-cuda-runtime`` wheel (or a
    CUDA toolkit) does.
    """
    global _default_includes
    if _default_includes is None:
        try:
            from cuda.pathfinder import find_nvidia_header_directory

            found = find_nvidia_header_directory("cudart")
        except Exception as exc:  # pathfinder raises its own error types per version
            log.debug("fxkern: no CUDA runtime headers found: %s", exc)
            found = None
        _default_includes = (found,) if found else ()
    return _default_includes


_default_includes: Optional[Tuple[str, ...]] = None


def nvrtc_version() -> Tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


@functools.lru_cache(maxsize=None)
def supported_archs() -> Tuple[int, ...]:
    """The archs this NVRTC compiles for (75, 80, ... 90, ...); empty where it cannot say."""
    from cuda.bindings import nvrtc

    try:
        err, archs = nvrtc.nvrtcGetSupportedArchs()
    except (AttributeError, RuntimeError):  # an NVRTC without the call
        return ()
    return tuple(archs) if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else ()


def normalize_arch(arch: str) -> str:
    """Accept ``sm_90``, ``compute_90``, ``90`` or ``9.0``; return ``sm_90``."""
    a = str(arch).strip().lower()
    a = a.removeprefix("sm_").removeprefix("compute_").replace(".", "")
    if not re.fullmatch(r"\d+[a-z]?", a):
        raise CompileError(f"arch {arch!r} is not an architecture like 'sm_90'")
    return f"sm_{a}"


def device_arch(override: Optional[str], major: int, minor: int) -> str:
    """The arch to compile for a device of compute capability ``major.minor``: ``sm_<major><minor>``, or
    the spec's normalised ``arch_override`` where it targets that device: an arch-specific target
    (``sm_90a``: wgmma, setmaxnreg) on its own arch, a family target (``sm_100f``) on any arch of its
    family (its major, a minor at least its own: sm_100f runs on sm_103)."""
    arch = f"sm_{major}{minor}"
    m = re.fullmatch(r"sm_(\d+)(\d)([a-z]?)", override or "")
    if m:
        o_major, o_minor, suffix = int(m[1]), int(m[2]), m[3]
        if (o_major, o_minor) == (major, minor) or (suffix == "f" and o_major == major and o_minor <= minor):
            return override
    return arch


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def quoted_headers(source: str, include_paths: Sequence[str] = ()) -> List[Tuple[str, str]]:
    """The user headers ``source`` includes with ``#include "..."`` (and they in turn), each as (path,
    sha256 of its contents), found as NVRTC finds them: the including header's directory, the working
    directory, then ``include_paths``. Part of the cache key, so an edited header is compiled again.
    ``<...>`` headers (CUDA's, the toolkit's) are keyed by NVRTC's version instead; a header not found
    is left to NVRTC's error."""
    found: Dict[str, str] = {}
    pending = [(name, None) for name in _QUOTED_INCLUDE.findall(source)]
    while pending:
        name, here = pending.pop()
        for directory in ([here] if here else []) + [os.getcwd(), *include_paths]:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                path = os.path.realpath(path)
                if path not in found:
                    with open(path, "rb") as f:
                        data = f.read()
                    found[path] = hashlib.sha256(data).hexdigest()
                    text = data.decode("utf-8", "replace")
                    pending += [(n, os.path.dirname(path)) for n in _QUOTED_INCLUDE.findall(text)]
                break
    return sorted(found.items())


def compile_source(
    source: str,
    name_expressions: Sequence[str],
    *,
    arch: str = DEFAULT_ARCH,
    std: str = "c++17",
    include_paths: Sequence[str] = (),
    filename: str = "kernel.cu",
    extra_options: Sequence[str] = (),
) -> CompiledKernel:
    """Compile (or fetch from the cache) ``source`` for ``arch``. ``extra_options`` go to NVRTC
    after fxkern's own (``--ptxas-options=-v`` puts ptxas's resource report in the log); they are
    part of the cache key."""
    arch = normalize_arch(arch)
    options = [f"--gpu-architecture={arch}", f"-std={std}", "-lineinfo"]
    options += [f"--include-path={p}" for p in (*include_paths, *default_include_paths())]
    options += list(extra_options)
    key_material = json.dumps(
        {
            "format": CACHE_FORMAT,
            "source": source,
            "names": list(name_expressions),
            "options": options,
            "nvrtc": nvrtc_version(),
            "filename": filename,
            "headers": quoted_headers(source, include_paths),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_material.encode()).hexdigest()
    directory = cache_dir()
    path = directory / f"{key}.json"

    def compile_now() -> CompiledKernel:
        t0 = time.perf_counter()
        compiled = _nvrtc_compile(source, name_expressions, options, arch, filename)
        _count("compiles")
        log.info("fxkern: compiled %s for %s with NVRTC in %.1f s", filename, arch, time.perf_counter() - t0)
        return compiled

    # The cache is best-effort: a directory that cannot be made, read, locked or written (a read-only
    # home in a container, a full disk) costs compiles, not the registration.
    try:
        directory.mkdir(parents=True, exist_ok=True)
        hit = _read_entry(path)
        if hit is None:
            lock = FileLock(str(path) + ".lock")
            lock.acquire()
    except OSError as exc:
        _uncached(directory, exc)
        return compile_now()
    if hit is not None:
        _count("hits")
        log.debug("fxkern: %s for %s from the kernel cache (%s)", filename, arch, path)
        return hit
    try:
        try:
            hit = _read_entry(path)  # another process may have compiled it meanwhile
        except OSError as exc:  # written meanwhile by another user's process, unreadable to us
            _uncached(directory, exc)
            hit = None
        if hit is not None:
            _count("hits")
            log.debug("fxkern: %s for %s from the kernel cache, written by another process (%s)", filename, arch, path)
            return hit
        compiled = compile_now()
        try:
            _write_entry(path, compiled)
        except OSError as exc:
            _uncached(directory, exc)
        return compiled
    finally:
        lock.release()


_uncached_dirs: set = set()


def _uncached(directory: Path, exc: OSError) -> None:
    """Say once per directory that the kernel cache there cannot be used, and how to point it elsewhere."""
    if directory not in _uncached_dirs:
        _uncached_dirs.add(directory)
        log.warning("fxkern: the kernel cache at %s cannot be used (%s); compiling without it. Set "
                    "FXKERN_CACHE_DIR to a writable directory to keep compiled kernels between runs", directory, exc)


def _count(what: str) -> None:
    with _stats_lock:  # compiles may run on several threads (``concurrently``)
        stats[what] += 1


# ---- compiling side by side -------------------------------------------------------

# Each NVRTC compile holds its own front end's memory: beyond this many at once a big machine gains
# little and spends memory.
MAX_WORKERS = 16


class _Blocks(threading.local):
    """The ``concurrently`` block open on this thread, if any (each thread has its own)."""

    pool: Optional[ThreadPoolExecutor] = None
    futures: Optional[List[Future]] = None


_blocks = _Blocks()


@contextlib.contextmanager
def concurrently(workers: Optional[int] = None) -> Iterator[None]:
    """Run the compiles started on this thread in this block through :func:`later` side by side,
    one thread per core (at most ``MAX_WORKERS`` unless ``workers`` says): NVRTC releases the GIL,
    so registering many kernels from a cold cache (the library's 30-odd programs take about a
    second each) takes about as long as the longest few. The block's end waits for all of them and
    raises the first failure."""
    if _blocks.pool is not None:  # nested: the outer block waits
        yield
        return
    workers = workers or min(os.cpu_count() or 1, MAX_WORKERS)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fxkern-nvrtc")
    futures: List[Future] = []
    _blocks.pool, _blocks.futures = pool, futures
    try:
        yield
    finally:
        _blocks.pool = None
        pool.shutdown(wait=True)
    for f in futures:
        f.result()


def later(compile_fn: Callable[[], T]) -> "Future[T]":
    """``compile_fn()`` started on the pool of this thread's :func:`concurrently` block, or run now
    (raising its error here) outside one; either way a future of its result."""
    pool = _blocks.pool
    if pool is not None:
        future = pool.submit(compile_fn)
        _blocks.futures.append(future)
        return future
    done: Future = Future()
    done.set_result(compile_fn())
    return done


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise CompileError(f"{what} failed: {msg.decode(errors='replace')}")


def _nvrtc_compile(source: str, names: Sequence[str], options: List[str], arch: str, filename: str) -> CompiledKernel:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        for name in names:
            (err,) = nvrtc.nvrtcAddNameExpression(prog, name.encode())
            _check(err, f"nvrtcAddNameExpression({name!r})")
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into these buffers: they must be fresh mutable memory (``b" " * 1`` is
        # CPython's shared one-byte object, and writing into it corrupts every b" " in the process).
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        build_log = bytes(buf).rstrip(b"\x00").decode(errors="replace").strip()
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(format_compile_error(filename, source, build_log))
        if build_log:
            log.info("NVRTC log for %s:\n%s", filename, build_log)
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = bytearray(size)
        _check(nvrtc.nvrtcGetPTX(prog, ptx)[0], "nvrtcGetPTX")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        lowered = {}
        for name in names:
            err, low = nvrtc.nvrtcGetLoweredName(prog, name.encode())
            _check(err, f"nvrtcGetLoweredName({name!r})")
            lowered[name] = low.decode()
        return CompiledKernel(arch, ptx.rstrip(b"\x00").decode(), bytes(cubin), lowered, build_log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def format_compile_error(filename: str, source: str, build_log: str) -> str:
    """NVRTC's log, followed by each source line it complains about, with context.

    Line numbers count from a ``#line 1 "<filename>"`` directive where the source has one (fxkern puts
    the fp16/bf16 headers before the user's code), so the lines shown are the ones NVRTC means.
    """
    lines = source.splitlines()
    marker = f'#line 1 "{filename}"'
    if marker in lines:
        lines = lines[lines.index(marker) + 1:]
    shown = []
    for m in re.finditer(rf"{re.escape(filename)}\((\d+)\)", build_log):
        n = int(m.group(1))
        if n in shown or not 1 <= n <= len(lines):
            continue
        shown.append(n)
    excerpt = []
    for n in shown[:5]:
        for k in range(max(1, n - 2), min(len(lines), n + 2) + 1):
            mark = ">>" if k == n else "  "
            excerpt.append(f"{mark} {k:4d} | {lines[k - 1]}")
        excerpt.append("")
    text = f"NVRTC could not compile {filename}:\n{build_log}"
    if excerpt:
        text += "\n\nsource:\n" + "\n".join(excerpt)
    if "__nv_name_map" in build_log:  # NVRTC's lookup of the kernel by name, not the user's code (found by a probe)
        text += ("\n\nfxkern looks the kernel up by KernelSpec.kernel_name from global scope: a kernel declared "
                 "inside a named namespace is not found there; declare the __global__ function outside the "
                 "namespace (its helpers may stay in it), or add `using namespace NAME;` after the namespace")
    return text.rstrip()


def _read_entry(path: Path) -> Optional[CompiledKernel]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        digest, _, body = raw.partition(b"\n")
        if hashlib.sha256(body).hexdigest().encode() != digest:
            raise ValueError("digest mismatch")
        data = json.loads(body)
        return CompiledKernel(
            data["arch"], data["ptx"], base64.b64decode(data["cubin"]), dict(data["lowered"]), data["log"]
        )
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("fxkern: cache entry %s is corrupt (%s); recompiling", path, exc)
        return None


def _write_entry(path: Path, c: CompiledKernel) -> None:
    body = json.dumps(
        {"arch": c.arch, "ptx": c.ptx, "cubin": base64.b64encode(c.cubin).decode(), "lowered": c.lowered, "log": c.log}
    ).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the signature check -------------------------------------------------------

_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)
# A parameter: ``.param .u64 x``, ``.param .align 8 .b8 s[16]``, or with a pointer's attributes after the
# type, as NVRTC writes them for sm_100 and later: ``.param .u64 .ptr .align 1 x`` (PTX ISA: .ptr
# .space .align), which the signature check once skipped, refusing every Blackwell kernel.
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)"
                    r"(?:\s+\.ptr(?:\s+\.(?:global|const|local|shared))?(?:\s+\.align\s+\d+)?)?"
                    r"\s+[\w$]+(?:\[(\d+)\])?")
_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4,
          "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def ptx_entries(ptx: str) -> Dict[str, List[PtxParam]]:
    """Every ``.entry`` in ``ptx`` with its parameter list."""
    entries = {}
    for m in _ENTRY.finditer(ptx):
        params = []
        for p in _PARAM.finditer(m.group(2)):
            ptype, count = p.group(1), int(p.group(2) or 1)
            params.append(PtxParam(ptype if not p.group(2) else f"{ptype}[{count}]", _SIZES.get(ptype, 0) * count))
        entries[m.group(1)] = params
    return entries


# What PTX declares for each kind of argument in our calling convention.
ACCEPTED = {
    "pointer": ({"u64", "s64", "b64"}, "a pointer (64-bit)"),
    "i32": ({"u32", "s32", "b32"}, "a 32-bit int"),
    "f32": ({"f32", "b32"}, "a 32-bit float"),
    "bool": ({"u8", "s8", "b8"}, "a bool (8-bit)"),
}


def check_signature(kernel: str, entry_params: Sequence[PtxParam], expected: Sequence["Param"]) -> None:  # noqa: F821
    """Raise :class:`SignatureMismatch` naming the first argument where PTX and spec disagree."""
    for i, (have, want) in enumerate(zip(entry_params, expected)):
        types, words = ACCEPTED[want.kind]
        if have.ptx_type not in types:
            raise SignatureMismatch(
                f"kernel {kernel!r}, parameter {i}: the spec puts {want.label} there, which is passed as "
                f"{words}, but the kernel declares .{have.ptx_type} ({have.size} bytes). Calling convention: "
                f"(inputs and scalars in declaration order, extras, outputs) = "
                f"({', '.join(p.label for p in expected)})"
            )
    if len(entry_params) != len(expected):
        if len(entry_params) < len(expected):
            missing = ", ".join(p.label for p in expected[len(entry_params):])
            what = f"the kernel has no parameter for {missing}"
        else:
            what = f"the kernel has {len(entry_params) - len(expected)} parameter(s) more than the spec declares"
        raise SignatureMismatch(
            f"kernel {kernel!r} takes {len(entry_params)} parameters but the spec implies {len(expected)}: "
            f"{what}. Calling convention: ({', '.join(p.label for p in expected)})"
        )
