"""NVRTC compile without a GPU, the disk cache, and the PTX signature check."""

import multiprocessing as mp
import os

import pytest
import torch

import fxkern
import seven_cases
from fxkern import (
    CompileError, Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, SameAs, ScalarInput, SignatureMismatch,
    compiler,
)
from fxkern.derive import plan_kernel
from fxkern.ops import compile_plan, kernel_source

ADD_SRC = 'extern "C" __global__ void add(const float* a, const float* b, int n, float* c) { int i = threadIdx.x; if (i < n) c[i] = a[i] + b[i]; }'


def test_registration_needs_no_gpu():
    # CI has no GPU and no driver: compiling must not touch either.
    c = compiler.compile_source(ADD_SRC, ["add"], arch="sm_90")
    assert ".target sm_90" in c.ptx and c.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("case", seven_cases.CASES, ids=lambda c: c.name)
def test_every_example_compiles_for_sm90_and_matches_its_spec(case):
    case.register()
    entry = fxkern.kernel_op(f"{seven_cases.NS}::{case.name}")
    compiled = compile_plan(entry.plan, entry.source, "sm_90")
    entries = compiler.ptx_entries(compiled.ptx)
    for expr in entry.plan.name_expressions():
        params = entries[compiled.entry(expr)]
        assert len(params) == len(entry.plan.params)


def test_ptx_entries_reads_parameter_types():
    c = compiler.compile_source(ADD_SRC, ["add"])
    assert [p.ptx_type for p in compiler.ptx_entries(c.ptx)["add"]] == ["u64", "u64", "u32", "u64"]


def test_templated_kernel_one_compile_all_dtypes(fresh_cache):
    spec = KernelSpec(seven_cases.SIGMOID, "sigmoid_kernel", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
                      extras=[Numel("x")], geometry=Elementwise(), dtypes=seven_cases.FLOATS)
    plan = plan_kernel(spec)
    c = compile_plan(plan, kernel_source(spec), "sm_90")
    assert compiler.stats["compiles"] == 1
    lowered = [c.entry(e) for e in plan.name_expressions()]
    assert len(set(lowered)) == 3 and all(name.startswith("_Z") for name in lowered)


def test_cache_hit_skips_nvrtc(fresh_cache):
    compiler.compile_source(ADD_SRC, ["add"])
    compiler.compile_source(ADD_SRC, ["add"])
    assert compiler.stats == {"compiles": 1, "hits": 1}
    compiler.compile_source(ADD_SRC, ["add"], arch="sm_80")  # another arch is another key
    assert compiler.stats["compiles"] == 2


def test_an_unusable_cache_directory_costs_compiles_not_the_registration(fresh_cache, monkeypatch, caplog):
    """A cache directory that cannot be made (here under a file; a read-only home in a container, a
    full disk) is skipped with one warning that names FXKERN_CACHE_DIR: the kernel still compiles
    (registration raised the OSError before, found by a review, 2026-11-26)."""
    blocker = fresh_cache.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FXKERN_CACHE_DIR", str(blocker / "cache"))
    first = compiler.compile_source(ADD_SRC, ["add"])
    again = compiler.compile_source(ADD_SRC, ["add"])
    assert first.cubin and again.ptx == first.ptx and compiler.stats == {"compiles": 2, "hits": 0}
    assert caplog.text.count("cannot be used") == 1 and "FXKERN_CACHE_DIR" in caplog.text


def test_an_edited_header_is_compiled_again(fresh_cache, tmp_path):
    """The cache key holds the contents of the headers a source includes in quotes (and theirs), so
    editing one compiles the kernel again: the key had only the include paths, and an edited header
    gave the stale binary (found by a review, 2026-11-26)."""
    inc = tmp_path / "inc"
    (inc / "sub").mkdir(parents=True)
    (inc / "val.h").write_text('#include "sub/inner.h"\n')
    src = '#include "val.h"\nextern "C" __global__ void k(float* y) { y[0] = VAL; }'
    ptx = {}
    for val in ("3.0f", "7.0f", "3.0f"):
        (inc / "sub" / "inner.h").write_text(f"#define VAL {val}\n")  # a header the header includes
        ptx.setdefault(val, []).append(compiler.compile_source(src, ["k"], include_paths=[str(inc)]).ptx)
    assert compiler.stats == {"compiles": 2, "hits": 1}  # 3.0f, 7.0f, then 3.0f from the cache
    assert ptx["3.0f"][0] == ptx["3.0f"][1] != ptx["7.0f"][0]
    assert "1077936128" in ptx["3.0f"][0] and "1088421888" in ptx["7.0f"][0]  # 3.0f and 7.0f, stored as their bits


def test_corrupt_entry_is_recompiled(fresh_cache, caplog):
    first = compiler.compile_source(ADD_SRC, ["add"])
    (entry,) = fresh_cache.glob("*.json")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0x55
    entry.write_bytes(bytes(data))
    again = compiler.compile_source(ADD_SRC, ["add"])
    assert compiler.stats["compiles"] == 2
    assert again.ptx == first.ptx
    assert "corrupt" in caplog.text
    entry.write_bytes(b"")  # truncated, as after a crash mid-write without atomic rename
    compiler.compile_source(ADD_SRC, ["add"])
    assert compiler.stats["compiles"] == 3


def _cold_start(cache_dir, queue):
    os.environ["FXKERN_CACHE_DIR"] = cache_dir
    from fxkern import compiler as c

    c.compile_source(ADD_SRC, ["add"], arch="sm_90")
    queue.put(c.stats["compiles"])


def test_concurrent_cold_start_compiles_once(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_cold_start, args=(str(tmp_path), queue)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    counts = [queue.get(timeout=5) for _ in procs]
    assert sum(counts) == 1, counts
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert not list(tmp_path.glob("*.tmp"))


def test_compile_error_shows_log_and_source_lines(fresh_cache):
    src = 'extern "C" __global__ void broken(float* x) {\n  int i = threadIdx.x;\n  x[i] = undefined_name;\n}\n'
    with pytest.raises(CompileError) as info:
        compiler.compile_source(src, ["broken"], filename="broken.cu")
    msg = str(info.value)
    assert "undefined_name" in msg and "identifier" in msg
    assert ">>    3 |   x[i] = undefined_name;" in msg


@pytest.mark.parametrize("wrap, found", [
    ("namespace foo {{\n{}\n}}", False),
    ("namespace foo {{\n{}\n}}\nusing namespace foo;", True),
    ("namespace {{\n{}\n}}", True),
])
def test_a_kernel_in_a_namespace_is_found_as_nvrtc_finds_it(fresh_cache, wrap, found):
    """NVRTC's lookup of a kernel in a named namespace failed with errors about __nv_name_map, which
    name nothing of the user's (found by a probe); where NVRTC finds it, it is fine."""
    src = wrap.format('extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.0f; }')
    if found:
        assert compiler.compile_source(src, ["k"], filename="k.cu").ptx
        return
    with pytest.raises(CompileError, match=r"declared inside a named namespace is not found there"):
        compiler.compile_source(src, ["k"], filename="k.cu")


def test_compile_error_lines_are_the_users_behind_the_half_headers(fresh_cache):
    # A spec declaring float16/bfloat16 gets their headers put before its source: the lines shown
    # must still be the ones NVRTC names, counted in the user's source.
    src = ("template <typename T>\n__global__ void broken(const T* a, int n, T* c) {\n"
           "  int i = threadIdx.x;\n  c[i] = undefined_name;\n}\n")
    spec = KernelSpec(src, "broken", inputs=[InputDecl("a")], outputs=[OutputDecl("c", SameAs("a"))],
                      extras=[Numel("a")], geometry=Elementwise(), dtypes=(torch.float16, torch.bfloat16))
    with pytest.raises(CompileError) as info:
        fxkern.cuda_kernel_op("fxkern_test::broken_behind_headers", spec)
    msg = str(info.value)
    assert "broken.cu(4)" in msg and ">>    4 |   c[i] = undefined_name;" in msg


def _plan(src, name, **kw):
    base = dict(inputs=[InputDecl("a"), InputDecl("b")], outputs=[OutputDecl("c", SameAs("a"))], extras=[Numel("a")], geometry=Elementwise())
    base.update(kw)
    return plan_kernel(KernelSpec(src, name, **base))


def test_signature_matches():
    compile_plan(_plan(ADD_SRC, "add"), ADD_SRC, "sm_90")


def test_signature_wrong_type_names_the_argument():
    src = 'extern "C" __global__ void add(const float* a, double b, int n, float* c) {}'
    with pytest.raises(SignatureMismatch, match=r"parameter 1: the spec puts input 'b' there.*\.f64"):
        compile_plan(_plan(src, "add"), src, "sm_90")


def test_signature_missing_output_names_it():
    src = 'extern "C" __global__ void add(const float* a, const float* b, int n) {}'
    with pytest.raises(SignatureMismatch, match=r"no parameter for output 'c'"):
        compile_plan(_plan(src, "add"), src, "sm_90")


def test_signature_extra_parameter():
    src = 'extern "C" __global__ void add(const float* a, const float* b, int n, float* c, float* d) {}'
    with pytest.raises(SignatureMismatch, match=r"1 parameter\(s\) more"):
        compile_plan(_plan(src, "add"), src, "sm_90")


def test_signature_scalar_and_extra_types():
    src = 'extern "C" __global__ void s(const float* x, float alpha, long long n, float* y) {}'
    plan = plan_kernel(KernelSpec(src, "s", inputs=[InputDecl("x"), ScalarInput("alpha", float)],
                                  outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")], geometry=Elementwise()))
    with pytest.raises(SignatureMismatch, match=r"parameter 2: the spec puts extra Numel\('x'\) there, which is passed as a 32-bit int"):
        compile_plan(plan, src, "sm_90")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100", "sm_100f", "sm_120"])
def test_every_example_kernel_passes_the_signature_check_on_newer_archs(arch):
    """NVRTC writes Blackwell's pointer parameters as ``.param .u64 .ptr .align 1 x``; the check read
    past them and refused every kernel taking a pointer for sm_100 and later (found by a review)."""
    seven_cases.register_all()
    entries = [fxkern.kernel_op(f"{seven_cases.NS}::{case.name}") for case in seven_cases.CASES]
    for entry in entries:
        compiled = compile_plan(entry.plan, entry.source, arch)  # the signature check runs in here
        params = compiler.ptx_entries(compiled.ptx)[compiled.entry(entry.plan.name_expressions()[0])]
        assert len(params) == len(entry.plan.params), (entry.qualname, params)


def test_arch_names():
    assert compiler.normalize_arch("90") == "sm_90"
    assert compiler.normalize_arch("compute_90a") == "sm_90a"
    assert compiler.normalize_arch("8.6") == "sm_86"
    with pytest.raises(CompileError):
        compiler.normalize_arch("hopper")


@pytest.mark.parametrize("override, capability, arch", [
    (None, (9, 0), "sm_90"),
    ("sm_90a", (9, 0), "sm_90a"),     # arch-specific: its own arch only
    ("sm_90a", (10, 0), "sm_100"),
    ("sm_100a", (10, 3), "sm_103"),
    ("sm_100f", (10, 3), "sm_100f"),  # family: sm_100f runs on sm_103 (found by a review: it compiled sm_103)
    ("sm_100f", (10, 0), "sm_100f"),
    ("sm_103f", (10, 0), "sm_100"),   # a family target above the device's minor does not run there
    ("sm_100f", (12, 0), "sm_120"),
    ("sm_80", (9, 0), "sm_90"),       # a plain arch of another GPU: the device's own
])
def test_the_arch_a_device_compiles_for(override, capability, arch):
    assert compiler.device_arch(override, *capability) == arch


def test_compile_leaves_interned_bytes_alone(fresh_cache):
    """NVRTC writes into the buffers fxkern hands it; they must never be CPython's shared
    one-byte object (an empty build log has size 1), or every b" " in the process changes."""
    from fxkern import compiler

    compiler.compile_source('extern "C" __global__ void k(float* x) {}', ("k",), arch="sm_90")
    assert b" " == bytes([32]) and b" " * 3 == bytes([32, 32, 32])


def test_registrations_in_a_concurrent_block_compile_side_by_side(fresh_cache, op_name, caplog):
    """Inside ``compiler.concurrently`` each registration's NVRTC compile runs on the block's thread
    pool; the ops are usable once the block ends, with their kernels compiled once each."""
    specs = [KernelSpec(seven_cases.SIGMOID, "sigmoid_kernel", inputs=[InputDecl("x")],
                        outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")], geometry=Elementwise(),
                        dtypes=dtypes)
             for dtypes in ((torch.float32,), (torch.float32, torch.float16))]  # two sources: two compiles
    caplog.set_level("INFO", logger="fxkern")
    with compiler.concurrently(workers=2):
        ops = [fxkern.cuda_kernel_op(f"{op_name}_{k}", spec, reference=torch.sigmoid) for k, spec in enumerate(specs)]
    assert compiler.stats["compiles"] == 2
    threads = {r.threadName for r in caplog.records if r.getMessage().startswith("fxkern: compiled ")}
    assert len(threads) >= 1 and all(t.startswith("fxkern-nvrtc") for t in threads), threads
    for k, op in enumerate(ops):
        entry = fxkern.kernel_op(f"{op_name}_{k}")
        assert entry.compiled.arch == "sm_90" and "sigmoid_kernel" in entry.compiled.ptx
        x = torch.randn(10)
        torch.testing.assert_close(op(x), torch.sigmoid(x))


def test_a_failed_compile_in_a_concurrent_block_raises_at_its_end(fresh_cache, op_name):
    spec = KernelSpec('extern "C" __global__ void broken(const float* x, int n, float* y) { y[0] = undefined_name; }',
                      "broken", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")],
                      geometry=Elementwise())
    with pytest.raises(CompileError, match="undefined_name"):
        with compiler.concurrently(workers=2):
            fxkern.cuda_kernel_op(op_name, spec, reference=torch.neg)
    with pytest.raises(CompileError, match="undefined_name"):  # and where the op's kernel is asked for
        fxkern.kernel_op(op_name).compiled
    with pytest.raises(CompileError, match="undefined_name"):  # registering it again compiles again
        fxkern.cuda_kernel_op(op_name, spec, reference=torch.neg)


def test_a_concurrent_block_is_its_own_threads(fresh_cache, op_name):
    """A registration on another thread while a block is open compiles on that thread, and its error
    is raised there, not at the end of the other thread's block."""
    import threading

    broken = KernelSpec('extern "C" __global__ void broken(const float* x, int n, float* y) { y[0] = nope; }',
                        "broken", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))], extras=[Numel("x")],
                        geometry=Elementwise())
    seen = []

    def other():
        try:
            fxkern.cuda_kernel_op(op_name, broken, reference=torch.neg)
        except CompileError as exc:
            seen.append(exc)

    with compiler.concurrently(workers=2):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1 and "nope" in str(seen[0])
