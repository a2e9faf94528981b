"""benchmarks/: what they do on a machine without a GPU (CI's): say so, and leave docs/benchmarks.md
(the sections measured on the device) as it is."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmarks' path on a machine without a GPU")
def test_benchmarks_without_a_gpu_leave_the_measured_sections_alone(monkeypatch, capsys):
    import cohere_tuning
    import common
    import gate_tuning
    import library
    import masked_tuning
    import past_int32
    import sink_tuning
    import softcap_tuning

    written = []
    monkeypatch.setattr(common, "write_section", lambda *a, **k: written.append(a))
    library.main([])
    masked_tuning.main(["--only", "staged"])
    softcap_tuning.main([])
    sink_tuning.main([])
    cohere_tuning.main([])
    gate_tuning.main([])
    past_int32.main([])
    assert written == []
    out = capsys.readouterr().out
    assert out.count("no GPU on this machine, nothing measured") == 7, out


@pytest.mark.parametrize("script,module,spec", [("rope_tuning", "rotary", None), ("norm_rope_tuning", "norm_rotary", None),
                                                ("masked_tuning", "softmax", "SCALED_MASKED_SOFTMAX"),
                                                ("softcap_tuning", "softmax", "SOFTCAPPED_MASKED_SOFTMAX"),
                                                ("sink_tuning", "softmax", "SINK_MASKED_SOFTMAX"),
                                                ("cohere_tuning", "layernorm", None),
                                                ("gate_tuning", "swiglu", "CLAMPED_SWIGLU")])
def test_every_tuning_variants_edits_find_their_text_in_the_kernel_source(script, module, spec):
    """A variant edits the shipped kernel's source by text (the module's SOURCE, or the source of the
    spec it varies): each edit's old text must still be there, or the variant would stop its script on
    the device (rope_tuning's evict-first variant did, once)."""
    import importlib

    variants = importlib.import_module(script).VARIANTS
    library = importlib.import_module(f"fxkern.library.{module}")
    source = getattr(library, spec).kernel_source if spec else library.SOURCE
    missing = [(label, old) for label, v in variants.items() if isinstance(v, dict)  # others are the library's ops
               for old, _ in v.get("edits", ()) if old not in source]
    assert not missing, missing


# The knobs benchmarks/masked_tuning.py and softcap_tuning.py turn to rerun the kernels shipped before
# them (the "shipped until" variants) and to time the settings not shipped.
SOFTMAX_KNOBS = {
    "float max": "#define FXK_PAIR_MAX 0\n",
    "one reduction": "#define FXK_TWO_REDUCTIONS 0\n",
    "two reductions everywhere": "#define FXK_TWO_REDUCTIONS 2\n#define FXK_TWO_REDUCTIONS_G 1024\n",
    "exp2f": "#define FXK_EXP_FTZ 0\n",
    # the EDGES kernels' (rows of an odd length) padding beside each load
    "EDGES padding beside the loads": "#define FXK_EDGES 1\n#define FXK_EDGES_PAD_APART 0\n",
}


@pytest.mark.parametrize("knob", list(SOFTMAX_KNOBS))
def test_softmax_knobs_the_tuning_scripts_turn_still_build(knob):
    """Each setting of softmax's knobs still compiles (NVRTC for sm_90, as registration compiles; no GPU
    needed): a knob whose other branch rotted would stop its tuning script on the device instead."""
    import dataclasses

    import fxkern
    from fxkern.library import softmax

    for i, base in enumerate((softmax.SCALED_MASKED_SOFTMAX, softmax.SOFTMAX)):
        spec = dataclasses.replace(base, kernel_source=SOFTMAX_KNOBS[knob] + softmax.SOURCE)
        fxkern.cuda_kernel_op(f"fxkern_test_knobs::{knob.replace(' ', '_')}_{i}", spec)  # raises CompileError
