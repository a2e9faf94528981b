"""benchmarks/: what they do on a machine without a GPU (CI's): say so, and leave docs/benchmarks.md
(the sections measured on the device) as it is."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmarks' path on a machine without a GPU")
def test_benchmarks_without_a_gpu_leave_the_measured_sections_alone(monkeypatch, capsys):
    import common
    import library
    import masked_tuning
    import softcap_tuning

    written = []
    monkeypatch.setattr(common, "write_section", lambda *a, **k: written.append(a))
    library.main([])
    masked_tuning.main(["--only", "staged"])
    softcap_tuning.main([])
    assert written == []
    out = capsys.readouterr().out
    assert out.count("no GPU on this machine, nothing measured") == 3, out
