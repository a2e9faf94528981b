"""Calls past a kernel's 32-bit limits cut into calls within them (fxkern.split, past_limits="split")."""

import itertools
import math

import pytest
import torch

import fxkern
import fxkern.library as lib
from fxkern import patterns, split
from fxkern.ops import kernel_op

GiB_ELEMENTS = 2**30


def test_attention_scores_at_8192_keys_are_cut_along_the_heads():
    """Batch 1, 32 heads, 8192 keys: 2^31 elements. The batch axis has one index, so the heads are
    cut, and the (1, 1, q, k) mask is read whole by both halves."""
    scores = (1, 32, 8192, 8192)
    cut = split.plan([scores, (1, 1, 8192, 8192), None], [scores])
    assert cut == split.Split(axis=1, pieces=(((0,), 0, 16), ((0,), 16, 16)))


def test_at_batch_2_each_piece_is_one_batch_index_and_half_its_heads():
    """One batch index of these scores is 2^31 elements itself: cut along the batch alone, each piece
    would be refused again and cut again through a second, whole-piece output."""
    scores = (2, 32, 8192, 8192)
    cut = split.plan([scores, (2, 1, 8192, 8192), None], [scores])
    assert cut.axis == 1
    assert cut.pieces == (((0,), 0, 16), ((0,), 16, 16), ((1,), 0, 16), ((1,), 16, 16))


@pytest.mark.parametrize("inputs, outputs", [
    ([(7, 2**27 + 2**26)], [(7, 2**27 + 2**26)]),  # 7 rows of 0.75 GiB: one row a piece
    ([(2, 32, 8192, 8192), (2, 1, 8192, 8192)], [(2, 32, 8192, 8192)]),
    ([(3, 5, 2**26)], [(3, 5, 2**26)]),
    ([(2, 6, 8), (8,)], [(2, 6, 8), (2, 6, 8)]),
])
def test_no_piece_holds_more_than_it_may(inputs, outputs):
    most = 10 if inputs[0] == (2, 6, 8) else split.PIECE
    cut = split.plan(inputs, outputs, most=most)
    rank = len(outputs[0])
    sizes = {(a, b) for _, a, b in cut.pieces}
    biggest = max(math.prod(split._size(s, rank, x) for x in range(cut.axis + 1, rank)) * n
                  for s in inputs + outputs for _, n in sizes if split._size(s, rank, cut.axis) > 1)
    assert biggest <= max(most, math.prod(outputs[0][cut.axis + 1:])), cut
    covered = [(*at, i) for at, start, n in cut.pieces for i in range(start, start + n)]
    assert sorted(covered) == list(itertools.product(*map(range, outputs[0][:cut.axis + 1])))  # each index once


def test_rows_are_cut_into_pieces_of_at_most_a_gib_of_elements():
    rows = (3 * 2**17 + 5, 8192)  # 3.0x 2^30 elements: four pieces
    cut = split.plan([rows, (8192,), None], [rows, rows])
    assert cut.axis == 0 and len(cut.pieces) == 4
    assert sum(n for _, _, n in cut.pieces) == rows[0]
    assert [s for _, s, _ in cut.pieces] == [0, *(s + n for _, s, n in cut.pieces[:-1])]
    assert max(n for _, _, n in cut.pieces) * 8192 <= GiB_ELEMENTS


def test_a_call_refused_at_a_small_size_is_still_cut_in_two():
    """A call within a GiB may be refused for another limit (a grid axis): it is halved. So is an empty
    one (an extra past int32 with no rows: it divided by zero, found by a review)."""
    assert split.plan([(6, 4)], [(6, 4)]) == split.Split(axis=0, pieces=(((), 0, 3), ((), 3, 3)))
    assert split.plan([(7, 4)], [(7, 4)]).pieces == (((), 0, 4), ((), 4, 3))
    assert split.plan([(2, 0, 5)], [(2, 0, 5)]).pieces == (((), 0, 1), ((), 1, 1))


@pytest.mark.parametrize("inputs, outputs, why", [
    ([(1, 2**31)], [(1, 2**31)], "one row: its last axis is never cut"),
    ([(2**31,)], [(2**31,)], "one axis, the last"),
    ([(4, 8), (3, 8)], [(4, 8)], "an input whose aligned axis is neither the output's size nor 1"),
    ([(4, 8)], [(4, 8), (4, 8, 2)], "outputs of different ranks"),
    ([(4, 8)], [(4, 8), (5, 8)], "outputs of different sizes on the cut axis"),
    ([(2, 4, 8)], [(4, 8)], "an input of higher rank than the outputs"),
    ([(4, 8)], [], "no outputs"),
])
def test_calls_that_cannot_be_cut(inputs, outputs, why):
    assert split.plan(inputs, outputs) is None, why


def test_run_writes_each_piece_into_its_part_of_the_outputs():
    """Pieces go to ``call`` as views of the inputs (a broadcast input whole), and their results land
    in outputs laid out as the fake impl's are (here transposed)."""
    x, w = torch.randn(6, 5), torch.randn(5)
    calls = []

    def call(x, w, scale):
        calls.append(tuple(x.shape))
        return x * w * scale, x.t().contiguous().t()

    expected = (torch.empty(6, 5), torch.empty(5, 6).t())
    cut = split.plan([(6, 5), (5,), None], [(6, 5), (6, 5)])
    y, z = split.run(call, (x, w, 2.0), cut, expected, single=False)
    assert calls == [(3, 5), (3, 5)]
    torch.testing.assert_close(y, x * w * 2.0, rtol=0, atol=0)
    assert torch.equal(z, x) and z.stride() == (1, 6)


def test_a_pieces_launch_writes_its_part_of_the_outputs_in_place():
    """A launch inside a piece takes that piece's slice of the whole output (``split.into``), so the
    piece's result needs no copy: what the launches wrote is the returned tensor's memory."""
    x = torch.randn(8, 4)
    wrote = []

    def call(x):
        (out,) = split.into([torch.empty_like(x)])
        wrote.append(out.data_ptr())
        return out.copy_(x * 2)

    y = split.run(call, (x,), split.plan([(8, 4)], [(8, 4)]), (torch.empty(8, 4),), single=True)
    assert torch.equal(y, x * 2)
    assert wrote == [y.data_ptr(), y[4:].data_ptr()]
    assert split.into([torch.empty(4, 4)])[0].data_ptr() not in wrote  # outside a piece: its own outputs


def test_a_launch_that_knows_its_outputs_takes_its_part_before_allocating_any():
    """The launch path's repeated signatures describe their outputs (``split.describe``) and take the
    piece's part with ``split.take``, allocating nothing; outside a piece, or where the description
    does not match, ``take`` gives None and the launch allocates its own."""
    x = torch.randn(8, 4)
    described = split.describe([torch.empty(4, 4)])
    assert split.take(described) is None  # outside a piece
    took = []

    def call(x):
        assert split.take(split.describe([torch.empty(4, 4, dtype=torch.float64)])) is None  # another dtype
        assert split.take(split.describe([torch.empty(4, 4).t()])) is None  # another layout
        (out,) = split.take(described)
        assert split.take(described) is None  # taken once a piece
        took.append(out.data_ptr())
        return out.copy_(x * 2)

    y = split.run(call, (x,), split.plan([(8, 4)], [(8, 4)]), (torch.empty(8, 4),), single=True)
    assert torch.equal(y, x * 2) and took == [y.data_ptr(), y[4:].data_ptr()]


def test_a_destination_taken_by_an_intermediate_launch_still_gives_the_right_result():
    """An eager_fn whose first launch makes an intermediate of the output's shape takes the piece's
    slice for it; its second launch gets its own output, and the piece's result is copied over."""
    x = torch.randn(8, 4)

    def call(x):
        (tmp,) = split.into([torch.empty_like(x)])
        tmp.copy_(x + 1)
        (res,) = split.into([torch.empty_like(x)])
        assert res.data_ptr() != tmp.data_ptr()
        return res.copy_(tmp * 2)

    y = split.run(call, (x,), split.plan([(8, 4)], [(8, 4)]), (torch.empty(8, 4),), single=True)
    assert torch.equal(y, (x + 1) * 2)


def test_a_destination_of_another_layout_is_not_taken():
    """The whole output transposed (as a fake impl may lay it out): a piece's slice is not the row-major
    block a launch writes, so the launch keeps its own output and the result is copied into place."""
    x = torch.randn(8, 4)
    taken = []

    def call(x):
        own = torch.empty_like(x)
        (out,) = split.into([own])
        taken.append(out is not own)
        return out.copy_(x * 3)

    y = split.run(call, (x,), split.plan([(8, 4)], [(8, 4)]), (torch.empty(4, 8).t(),), single=True)
    assert taken == [False, False] and torch.equal(y, x * 3) and y.stride() == (1, 8)


def test_run_cuts_a_masked_softmax_by_batch_index_and_heads():
    """Transformers' scores at batch 2 with a (b, 1, q, k) mask, through the library op's reference, cut
    as a call past the limits is: one batch index and a few heads a piece, the mask's batch index
    sliced, its head axis read whole."""
    from fxkern.library import softmax

    torch.manual_seed(0)
    x, mask = torch.randn(2, 6, 5, 8), torch.randn(2, 1, 5, 8)
    want = softmax.scaled_masked_softmax(x, mask, 0.5)
    cut = split.plan([(2, 6, 5, 8), (2, 1, 5, 8), None], [(2, 6, 5, 8)], most=2 * 5 * 8)  # two heads a piece
    assert cut.axis == 1 and len(cut.pieces) == 6
    seen = []

    def call(x, mask, scale):
        seen.append((tuple(x.shape), tuple(mask.shape)))
        return softmax.scaled_masked_softmax(x, mask, scale)

    got = split.run(call, (x, mask, 0.5), cut, (torch.empty(2, 6, 5, 8),), single=True)
    assert seen == [((1, 2, 5, 8), (1, 1, 5, 8))] * 6
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_outputs_returned_in_another_order_than_launched_are_still_right():
    """An eager_fn whose one launch writes (y, h) and which returns (h, y): the launch took the piece's
    parts in its own order, so each result lies in the other's part; both are read before either copy."""
    x = torch.randn(4, 3)

    def call(x):
        y, h = split.into([torch.empty_like(x), torch.empty_like(x)])
        y.copy_(x * 2)
        h.copy_(x + 1)
        return h, y

    h, y = split.run(call, (x,), split.plan([(4, 3)], [(4, 3), (4, 3)]), (torch.empty(4, 3), torch.empty(4, 3)),
                     single=False)
    assert torch.equal(h, x + 1) and torch.equal(y, x * 2)


@pytest.mark.parametrize("returned", [lambda x: x[:, :2] * 2, lambda x: (x, x), lambda x: x.double()])
def test_a_piece_that_returns_other_than_its_part_is_an_error(returned):
    x = torch.randn(4, 3)
    with pytest.raises(fxkern.SpecError, match="its CUDA impl and its fake impl|CUDA impl and its fake impl"):
        split.run(returned, (x,), split.plan([(4, 3)], [(4, 3)]), (torch.empty(4, 3),), single=True, op="t::op")


def _op_args(rule, dtype):
    """The rule's op arguments in its own order, from the rule's example inputs with random values."""
    examples = [torch.randn(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) and a.dtype.is_floating_point else a
                for a in rule.examples(dtype)]
    names = [p.name for p in patterns.pattern_params(rule.pattern)]
    return tuple(examples[names.index(n)] for n in rule.arg_params)


def _cut_and_whole(entry, args):
    whole = entry.reference(*args)
    outs = whole if isinstance(whole, tuple) else (whole,)
    cut = split.plan([tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args],
                     [tuple(o.shape) for o in outs])
    return cut, outs, not isinstance(whole, tuple)


def _library_ops(past_limits):
    seen = {}
    for rule in lib.rules():
        entry = kernel_op(rule.overload.name())
        if entry.past_limits == past_limits:
            seen.setdefault(entry.qualname, rule)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_library_op_that_splits_computes_the_same_in_pieces(dtype):
    """The promise ``past_limits="split"`` makes, checked on each library op that makes it: its
    reference (the model's code) run in two pieces, as a refused call would run, gives the whole
    call's numbers (float32 to an ulp: PyTorch's CPU kernels vectorise a piece's tail otherwise)."""
    torch.manual_seed(0)
    ops = _library_ops("split")
    assert len(ops) > 30
    for qualname, rule in ops.items():
        entry = kernel_op(qualname)
        args = _op_args(rule, dtype)
        cut, outs, single = _cut_and_whole(entry, args)
        assert cut is not None, f"{rule.name}: its example inputs cannot be cut"
        got = split.run(entry.reference, args, cut, outs, single=single)
        for g, o in zip(got if not single else (got,), outs):
            torch.testing.assert_close(g, o, rtol=2e-7 if dtype == torch.float32 else 0, atol=1e-7 if dtype == torch.float32 else 0,
                                       msg=lambda m: f"{rule.name}: {m}")


def test_the_library_ops_that_cannot_be_cut_do_not_promise_it():
    """The sink softmax and the repeating rotations take their scores' or keys' sizes as scalars
    (batch, kv_heads), so a piece's call disagrees with them: those ops run their reference past
    the limits (``past_limits="reference"``), and would fail cut."""
    torch.manual_seed(0)
    fails, repeating = set(), set()
    for qualname, rule in _library_ops("reference").items():
        args = _op_args(rule, torch.float32)
        entry = kernel_op(qualname)
        cut, outs, single = _cut_and_whole(entry, args)
        assert cut is not None, f"{rule.name}: its example inputs cannot be cut"
        if "repeat_kv" in qualname:
            repeating.add(qualname)
        try:
            split.run(entry.reference, args, cut, outs, single=single)
        except RuntimeError:
            fails.add(qualname)
    assert {"fxkern_lib::sink_masked_softmax", "fxkern_lib::repeat_kv"} <= fails
    assert len(repeating) >= 4 and repeating <= fails


# ---- the CUDA impl's routing, on CPU tensors -------------------------------------------------


def _refuses_past(limit):
    """An eager_fn standing in for a kernel that takes at most ``limit`` elements (it refuses larger
    calls before any launch, as the launch path does); it records the sizes it ran."""
    ran = []

    def eager(x, alpha):
        if x.numel() > limit:
            raise fxkern.SizeLimitError(f"x has {x.numel()} elements, past the kernel's {limit}",
                                        f"x has {x.numel()} elements")
        ran.append(tuple(x.shape))
        return x * alpha

    return eager, ran


def _scale_spec():
    from test_ops import scale_spec
    return scale_spec()


def test_a_refused_call_runs_in_pieces_cut_again_where_still_too_large(op_name, caplog):
    eager, ran = _refuses_past(8)
    reference_calls = []

    def reference(x, alpha):
        reference_calls.append(tuple(x.shape))
        return x * alpha

    fxkern.cuda_kernel_op(op_name, _scale_spec(), reference=reference, eager_fn=eager, past_limits="split")
    cuda = kernel_op(op_name).cuda_impl
    x = torch.randn(4, 6)
    with caplog.at_level("INFO", logger="fxkern"):
        torch.testing.assert_close(cuda(x, 2.0), x * 2.0, rtol=0, atol=0)
    assert ran == [(1, 6)] * 4 and not reference_calls  # 24 elements: two pieces of 12, each cut again
    assert "run as several calls within them" in caplog.text


def test_a_refused_call_that_cannot_be_cut_runs_the_reference(op_name, caplog):
    """One row past the limit: no axis to cut but the last, so the reference runs, and says so."""
    eager, ran = _refuses_past(8)
    fxkern.cuda_kernel_op(op_name, _scale_spec(), reference=lambda x, a: x * a, eager_fn=eager, past_limits="split")
    x = torch.randn(1, 12)
    with caplog.at_level("WARNING", logger="fxkern"):
        torch.testing.assert_close(kernel_op(op_name).cuda_impl(x, 2.0), x * 2.0)
    assert not ran and "run the op's reference instead" in caplog.text


def test_a_transposed_input_is_cut_and_the_result_keeps_the_fake_impls_layout(op_name):
    eager, ran = _refuses_past(12)
    fxkern.cuda_kernel_op(op_name, _scale_spec(), reference=lambda x, a: x * a, eager_fn=eager,
                          meta_fn=lambda x, a: torch.empty_like(x), past_limits="split")
    x = torch.randn(6, 4).t()
    y = kernel_op(op_name).cuda_impl(x, 3.0)
    torch.testing.assert_close(y, x * 3.0, rtol=0, atol=0)
    assert y.stride() == x.stride() and ran == [(2, 6), (2, 6)]


def test_past_limits_split_needs_a_reference_and_a_spec_target(op_name):
    with pytest.raises(fxkern.SpecError, match="past_limits='split' needs reference="):
        fxkern.cuda_kernel_op(op_name, _scale_spec(), past_limits="split")
    op = fxkern.cuda_kernel_op(op_name, _scale_spec(), reference=lambda x, a: x * a)

    def pattern(x, alpha: float):
        return x * alpha

    with pytest.raises(fxkern.SpecError, match="past_limits= is for a KernelSpec target"):
        fxkern.replace(pattern, op, rules=fxkern.RuleSet("t"), past_limits="split")
