"""Spec validation and what a plan derives: schema, calling convention, geometry."""

import re

import pytest
import torch

from fxkern import (
    Custom, DimSize, Elementwise, InputDecl, KernelSpec, Numel, OutputDecl, ReduceDims, Reduction,
    SameAs, ScalarInput, SignatureMismatch, SpecError, cdiv,
)
from fxkern import symbolic as sym
from fxkern.derive import plan_kernel

SRC = 'extern "C" __global__ void k(const float* x, int n, float* y) {}'


def spec(**kw):
    base = dict(
        kernel_source=SRC, kernel_name="k", inputs=[InputDecl("x")], outputs=[OutputDecl("y", SameAs("x"))],
        extras=[Numel("x")], geometry=Elementwise(),
    )
    base.update(kw)
    return KernelSpec(**base)


def evaluate(expr, ins, outs=()):
    return sym.compile_expr(expr)((ins, outs))


def test_spec_is_frozen():
    s = spec()
    with pytest.raises(Exception):
        s.kernel_name = "other"


def test_schema_and_calling_convention():
    p = plan_kernel(spec(inputs=[InputDecl("x"), ScalarInput("alpha", float), ScalarInput("k", int), ScalarInput("b", bool)]))
    assert p.schema == "(Tensor x, float alpha, int k, bool b) -> Tensor"
    assert [(q.kind, q.role) for q in p.params] == [
        ("pointer", "input"), ("f32", "scalar"), ("i32", "scalar"), ("bool", "scalar"), ("i32", "extra"), ("pointer", "output"),
    ]


def test_multi_output_schema():
    p = plan_kernel(spec(outputs=[OutputDecl("s", SameAs(0)), OutputDecl("c", SameAs("x"))]))
    assert p.schema == "(Tensor x) -> (Tensor, Tensor)"
    assert p.output_names == ("s", "c")


@pytest.mark.parametrize(
    "kw, field, words",
    [
        (dict(kernel_name="not an id"), "kernel_name", "identifier"),
        (dict(kernel_name="missing"), "kernel_name", "does not appear"),
        (dict(inputs=[]), "inputs", "at least one"),
        (dict(inputs=[InputDecl("x"), InputDecl("x")]), "inputs[1]", "duplicate"),
        (dict(inputs=[ScalarInput("a", float)]), "inputs", "tensor InputDecl"),
        (dict(inputs=[InputDecl("x"), ScalarInput("a", str)]), "inputs[1]", "py_type"),
        (dict(inputs=[InputDecl("x", dtype="float32")]), "inputs[0].dtype", "not a supported dtype"),
        (dict(outputs=[OutputDecl("y", SameAs("nope"))]), "outputs[0].shape", "not a tensor input"),
        (dict(outputs=[OutputDecl("y", SameAs(3))]), "outputs[0].shape", "out of range"),
        (dict(outputs=[OutputDecl("y", ReduceDims("x", ()))]), "outputs[0].shape", "non-empty"),
        (dict(outputs=[OutputDecl("y", SameAs("x"), dtype_from="z")]), "outputs[0].dtype_from", "not a tensor input"),
        (dict(outputs=[OutputDecl("x", SameAs("x"))]), "outputs[0]", "duplicate"),
        (dict(outputs=None), "outputs", "OutputDecl"),
        (dict(extras=[Numel("nope")]), "extras[0]", "not a tensor input"),
        (dict(extras=[DimSize("x", "last")]), "extras[0]", "axis"),
        (dict(geometry=None), "geometry", "required"),
        (dict(geometry=Elementwise(block=(0,))), "geometry", "positive"),
        (dict(geometry=Elementwise(block=(64, 64))), "geometry", "1024"),
        (dict(geometry=Elementwise(block=(16, 16))), "geometry", "1-D block"),
        (dict(geometry=Elementwise(layout="tiled")), "geometry", "layout"),
        (dict(geometry=Reduction(reduce_dims=())), "geometry", "reduce_dims"),
        (dict(geometry=Reduction(reduce_dims=(-1,), block_size=2048)), "geometry", "block_size"),
        (dict(geometry=Custom(lambda i, o: "nonsense")), "geometry", "Custom.fn must return"),
        (dict(geometry=Custom(lambda i, o: ((1.5,), (32,)))), "geometry", "Custom.fn"),
        (dict(geometry=Custom(lambda i, o: ((0,), (32,)))), "geometry", "no block would ever run"),
        (dict(compile_std="c++99"), "compile_std", "one of c++03"),
        (dict(arch_override="sm90"), "arch_override", "not an architecture like 'sm_90'"),
        (dict(arch_override="sm_10"), "arch_override", "not an arch this NVRTC compiles for"),
        (dict(dtypes=()), "dtypes", "empty"),
        (dict(dtypes=(torch.float32, torch.float32)), "dtypes", "twice"),
        (dict(dtypes=(torch.complex64,)), "dtypes", "not a supported dtype"),
    ],
)
def test_bad_specs_name_the_field(kw, field, words):
    with pytest.raises(SpecError) as info:
        plan_kernel(spec(**kw))
    msg = str(info.value)
    assert msg.startswith(f"KernelSpec.{field}:"), msg
    assert words in msg


TEMPLATE_SRC = "template <typename T>\n__global__ void __launch_bounds__(256) k(const T* x, int n, T* y) {}"
HELPER_SRC = "__device__ float k(float v) { return v; }\n" + SRC.replace("void k(", "void k_kernel(")


@pytest.mark.parametrize("kw, field, words", [
    (dict(kernel_source=HELPER_SRC, kernel_name="k_kern"), "kernel_name", "only inside other names (k_kernel)"),
    (dict(kernel_source=HELPER_SRC), "kernel_name", "'k' is a __device__ function, not a kernel"),
    (dict(kernel_source=TEMPLATE_SRC), "dtypes", "k is a template: give dtypes="),
    (dict(dtypes=(torch.float32, torch.float16)), "dtypes", "the kernel is no template"),
])
def test_kernel_name_and_template_mistakes_are_named_before_nvrtc(kw, field, words):
    """NVRTC's name lookup failed on these with errors about __nv_name_map, naming no field (found by a
    usability test)."""
    with pytest.raises(SpecError) as info:
        plan_kernel(spec(**kw))
    assert str(info.value).startswith(f"KernelSpec.{field}:") and words in str(info.value), str(info.value)


def test_a_templated_kernel_with_dtypes_and_a_macro_kernel_pass():
    plan_kernel(spec(kernel_source=TEMPLATE_SRC, dtypes=(torch.float32, torch.float16)))
    macro = "#define KERNEL(name) extern \"C\" __global__ void name(const float* x, int n, float* y) {}\nKERNEL(k)"
    plan_kernel(spec(kernel_source=macro))  # left to NVRTC
    # comments are not code: a ';' or '{' in one, or a word 'template' (found by a review)
    commented = "template <typename T>  // T: float; or __half {f32, f16}\n__global__ void k(const T* x, int n, T* y) {}"
    plan_kernel(spec(kernel_source=commented, dtypes=(torch.float32, torch.float16)))
    plan_kernel(spec(kernel_source="/* not the template <typename T> one */\n" + SRC))


def test_elementwise_flat_geometry():
    p = plan_kernel(spec(geometry=Elementwise(block=(128,))))
    env = ([(10, 100)], [(10, 100)])
    assert [sym.compile_expr(g)(env) for g in p.grid] == [8, 1, 1]
    assert p.block == (128, 1, 1)
    assert [sym.compile_expr(e)(env) for e in p.extras] == [1000]


def test_elementwise_nd_folds_leading_axes_into_grid_z():
    p = plan_kernel(spec(geometry=Elementwise(block=(32, 8), layout="nd")))
    env = ([(4, 5, 17, 70)], [(4, 5, 17, 70)])
    assert [sym.compile_expr(g)(env) for g in p.grid] == [3, 3, 20]
    assert p.block == (32, 8, 1)
    assert p.min_out_rank == 2


def test_reduction_geometry_counts_rows():
    p = plan_kernel(spec(outputs=[OutputDecl("y", ReduceDims("x", (-1,)))], geometry=Reduction(reduce_dims=(-1,), block_size=128)))
    env = ([(3, 7, 1000)], [(3, 7)])
    assert [sym.compile_expr(g)(env) for g in p.grid] == [21, 1, 1]
    assert sym.compile_shape(p.output_shapes[0])(env) == [3, 7]


def test_reduce_dims_keepdim_shape():
    p = plan_kernel(spec(outputs=[OutputDecl("y", ReduceDims("x", (0, -1), keepdim=True))]))
    assert sym.compile_shape(p.output_shapes[0])(([(3, 7, 5)], ())) == [1, 7, 1]


def test_custom_geometry_is_symbolic():
    p = plan_kernel(spec(geometry=Custom(lambda ins, outs: ((cdiv(outs[0].numel(), 64), ins[0][0]), (64,), 128))))
    env = ([(6, 10)], [(12, 10)])
    assert [sym.compile_expr(g)(env) for g in p.grid] == [2, 6, 1]
    assert sym.compile_expr(p.shared_mem)(env) == 128


def test_custom_geometry_cannot_branch_on_sizes():
    def branchy(ins, outs):
        if ins[0][0] > 5:
            return (1,), (32,)
        return (2,), (32,)

    with pytest.raises((SpecError, TypeError)):
        plan_kernel(spec(geometry=Custom(branchy)))


def test_dtype_from_and_templated_name_expressions():
    p = plan_kernel(spec(
        kernel_source=TEMPLATE_SRC,
        inputs=[InputDecl("x"), InputDecl("idx", dtype=torch.int32)],
        outputs=[OutputDecl("y", SameAs("x")), OutputDecl("i", SameAs("idx"), dtype_from="idx")],
        dtypes=(torch.float32, torch.bfloat16),
    ))
    assert p.output_dtype_from == (None, 1)
    assert p.name_expressions() == ("k<float>", "k<__nv_bfloat16>")


def test_override_path_needs_no_outputs_with_meta_fn_and_schema():
    p = plan_kernel(spec(outputs=None, geometry=Custom(lambda i, o: ((1,), (32,)))), has_meta_fn=True, schema="(Tensor x) -> Tensor")
    assert p.output_shapes is None
    assert p.params[-1].role == "output"


def test_one_dtype_for_a_list_of_them_says_so():
    """dtypes=torch.float16 raised a bare "'torch.dtype' object is not iterable" (found by a usability test)."""
    with pytest.raises(SpecError, match=r"dtypes: is torch.float16, one dtype: give a list or tuple of them"):
        plan_kernel(spec(dtypes=torch.float16))


@pytest.mark.parametrize("source, inputs, outputs, words", [
    ('extern "C" __global__ void k(const float* b, const float* a, int n, float* y) {}',
     [InputDecl("a"), InputDecl("b")], [OutputDecl("y", SameAs("a"))],
     "parameter 0 is named 'b', but the spec puts input 'a' there"),
    ('extern "C" __global__ void k(const double* x, int n, float* y) {}',
     None, None, "points to double, 8-byte elements, but input 'x' is a torch.float32 tensor"),
    ('extern "C" __global__ void k(const int* x, int n, float* y) {}',
     [InputDecl("x", dtype=torch.int64)], [OutputDecl("y", SameAs("x"), dtype_from=None)],
     "points to int, 4-byte elements, but input 'x' is a torch.int64 tensor"),
    ('extern "C" __global__ void k(const long long* x, int n, float* y) {}',
     [InputDecl("x", dtype=torch.int64)], None, "set OutputDecl.dtype_from"),
    ('typedef double real;\nextern "C" __global__ void k(const real* x, int n, float* y) {}',
     None, None, "points to real (double), 8-byte elements"),
    ('using real = double;\nextern "C" __global__ void k(const real* x, int n, float* y) {}',
     None, None, "points to real (double), 8-byte elements"),
    ('#define real_t double\ntypedef real_t scalar;\nextern "C" __global__ void k(const scalar* x, int n, float* y) {}',
     None, None, "points to scalar (double), 8-byte elements"),
], ids=["inputs swapped", "double for float32", "int for int64", "float output of an int64 input",
        "a typedef", "a using alias", "a macro behind a typedef"])
def test_the_kernels_own_parameter_list_is_checked(source, inputs, outputs, words):
    """PTX passes every pointer as .u64: a kernel taking (b, a) for inputs [a, b] computed b - a,
    and a double* read a float32 tensor's bytes (found by a probe). The declaration tells."""
    kw = {"kernel_source": source, "extras": [Numel(inputs[0].name if inputs else "x")]}
    if inputs is not None:
        kw["inputs"] = inputs
    if outputs is not None:
        kw["outputs"] = outputs
    with pytest.raises(SignatureMismatch, match=re.escape(words)):
        plan_kernel(spec(**kw))


@pytest.mark.parametrize("source", [
    'extern "C" __global__ void k(const float* __restrict__ in, int count, float* __restrict__ out) {}',
    'extern "C" __global__ void k(const float4* x, int n, float4* y) {}',
    'template <typename T> __global__ void k(const T* x, int n, T* y) {}',
    'extern "C" __global__ void k(const float* a, int n, float* x) {}',
    'extern "C" __global__ void k(const int* x, int n, float* y) {}',
    'typedef float real;\nusing out_t = float;\nextern "C" __global__ void k(const real* x, int n, out_t* y) {}',
    'typedef double scalar_t;\ntemplate <typename scalar_t> __global__ void k(const scalar_t* x, int n, scalar_t* y) {}',
], ids=["other names", "vector types", "a template's T", "a name of another role", "float32 bits as int",
        "aliases of float", "a template parameter named as a typedef"])
def test_names_and_types_the_spec_does_not_know_are_the_authors(source):
    """A name the spec gives a parameter of another role (the output called like the input), and
    elements of the tensor's size read as another type, are the author's (found by a review)."""
    dtypes = [torch.float32, torch.float16] if "template" in source else None
    plan_kernel(spec(kernel_source=source, dtypes=dtypes))


def test_a_bool_mask_read_as_bytes_and_a_meta_fn_output_are_the_authors():
    src = 'extern "C" __global__ void k(const float* x, const unsigned char* m, int n, float* y) {}'
    plan_kernel(spec(kernel_source=src, inputs=[InputDecl("x"), InputDecl("m", dtype=torch.bool)]))
    src = 'template <typename T> __global__ void k(const T* x, int n, float* y) {}'
    plan_kernel(spec(kernel_source=src, dtypes=[torch.float16]), has_meta_fn=True)  # meta_fn says float32
    with pytest.raises(SignatureMismatch, match="output 'y' is a torch.float16 tensor"):
        plan_kernel(spec(kernel_source=src, dtypes=[torch.float16]))


def test_an_elementwise_block_may_be_one_int():
    """Elementwise(block=256) failed with "'int' object is not iterable" (found by a probe)."""
    assert plan_kernel(spec(geometry=Elementwise(block=256))).block == (256, 1, 1)


@pytest.mark.parametrize("paths, words", [("/usr/include", "give a list of directories"),
                                          (["/no/such/dir"], "is not a directory here")])
def test_include_paths_are_checked(paths, words):
    """A string was read as one directory per character, and NVRTC then missed the header without
    naming include_paths (found by a probe)."""
    with pytest.raises(SpecError, match=f"KernelSpec.include_paths: .*{words}"):
        plan_kernel(spec(include_paths=paths))


def test_helpers_in_a_namespace_and_a_kernel_outside_it_are_fine():
    helpers = "namespace fxk { struct S { int a; }; __device__ float twice(float v) { return 2 * v; } }\n"
    assert plan_kernel(spec(kernel_source=helpers + SRC)).kernel_name == "k"
