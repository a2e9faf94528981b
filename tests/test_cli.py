"""``python -m fxkern demo`` and ``explain`` on the CPU: the main job end to end, and every
error a user can make on the command line giving one clear line and a non-zero exit."""

import os
import re
import subprocess
import textwrap
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import spec_like

import fxkern
from fxkern import cli, demo

ROOT = Path(__file__).resolve().parents[1]


def swiglu(a, b):
    return F.silu(a) * b


def _rules():
    rs = fxkern.RuleSet("cli-test")
    fxkern.replace(swiglu, spec_like(swiglu), name="fxkern_test_cli::swiglu", rules=rs)
    return rs


RULES = _rules()  # what --rules test_cli:RULES names (tests/ is on sys.path, as for helpers)


def not_rules():
    return [1, 2]


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """The demo's tiny model, exported and saved as a .pt2."""
    cfg = demo.SIZES["tiny"]
    model = demo.build_model(cfg, torch.device("cpu"), torch.float32)
    ep = torch.export.export(model, (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq)),))
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.export.save(ep, str(path))
    return path


def _replaced(out):
    """{rule: replaced count} from the demo's match table."""
    table = out.split("what the rules replaced, and where:")[1].split("\n\n")[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+) +(\d+) +\d+ ", table, re.MULTILINE)}


# ---- demo ---------------------------------------------------------------------------------


def test_demo_runs_end_to_end_on_cpu_with_the_library():
    """The README's main job, as a user runs it: a subprocess, default rules (fxkern.library)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fxkern", "demo", "--size", "tiny", "--device", "cpu"],
                          check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "no CUDA GPU is visible" in out or "--device cpu" in out
    assert "what the rules replaced, and where:" in out
    assert "verify (rewritten vs original" in out and ": ok" in out
    replaced = _replaced(out)
    # tiny: 2 layers x (2 norms + the GELU block's) + the final norm; one MLP, attention, GELU block per
    # layer. The norms after an attention or MLP residual add take the add with them (4); the first
    # reads the embeddings and two follow a GELU block, whose rule takes its residual add (3).
    assert replaced["add_rms_norm"] == 4 and replaced["rms_norm"] == 3, out
    assert replaced["swiglu"] == 2 and replaced["scaled_masked_softmax_float32"] == 2, out
    assert sum(n for rule, n in replaced.items() if rule.startswith("bias_gelu_tanh")) == 2, out
    assert "demo.py:" in out  # locations point at the model code
    assert "loading the rules" in proc.stderr
    assert re.search(r"^rules: \d+ in 'fxkern.library'; \d+ kernel ops registered \(\d+ compiled with NVRTC", out, re.M), out


def test_demo_with_named_rules_prints_the_match_table(capsys):
    assert cli.main(["demo", "--size", "tiny", "--device", "cpu", "--rules", "test_cli:RULES"]) == 0
    out = capsys.readouterr().out
    assert _replaced(out) == {"swiglu": 2}  # one SwiGLU per layer
    assert re.search(r"^swiglu .* demo\.py:\d+ ×2$", out, re.MULTILINE), out
    assert "max abs err" in out and "tol 1e-04" in out
    assert "does not time anything" in out


def test_demo_exits_nonzero_when_verification_fails(capsys, monkeypatch):
    monkeypatch.setitem(demo.TOLERANCE, torch.float32, -1.0)
    assert cli.main(["demo", "--size", "tiny", "--device", "cpu", "--rules", "test_cli:RULES"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "FAILED" in out


def test_demo_size_flags_override_the_preset():
    args = cli.build_parser().parse_args(["demo", "--size", "tiny", "--hidden", "32", "--layers", "1", "--device", "cpu"])
    cfg, device, dtype = demo.resolve(args)
    assert (cfg.hidden, cfg.layers, cfg.seq) == (32, 1, demo.SIZES["tiny"].seq)
    assert device.type == "cpu" and dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_demo_names_the_device_asked_for_without_a_gpu():
    """It said "--device cuda:" for --device cuda:1 (found by a usability test)."""
    args = cli.build_parser().parse_args(["demo", "--device", "cuda:1"])
    with pytest.raises(cli.CliError, match=r"--device cuda:1: no CUDA GPU is visible"):
        demo.resolve(args)


def test_demo_trt_says_why_it_is_unavailable(capsys):
    assert cli.main(["demo", "--size", "tiny", "--device", "cpu", "--rules", "test_cli:RULES", "--trt"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--trt"))
    ok, why = demo._trt_status()
    assert not ok and why and why in line


def _time_demo(monkeypatch, ms_by_variant):
    """The GPU-only timing step, run on the CPU: the CUDA timer replaced by ``ms_by_variant`` (in
    the order the variants are timed), a CUDA graph by the function itself."""
    times = iter(ms_by_variant)
    monkeypatch.setattr(demo, "cuda_time_ms", lambda fn: (fn(), next(times))[1])
    monkeypatch.setattr(demo, "cuda_graph", lambda fn, ids: fn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    cfg = demo.SIZES["tiny"]
    model = demo.build_model(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    rewritten = fxkern.apply(torch.export.export(model, (ids,)), RULES).module()
    with torch.no_grad():
        want = model(ids)
    args = cli.build_parser().parse_args(["demo", "--no-compile"])
    return demo._time_all(args, model, rewritten, RULES, ids, want, torch.float32, sys.stdout, sys.stderr)


def test_demo_timing_table_checks_every_variant(monkeypatch, capsys):
    assert _time_demo(monkeypatch, [8.8, 4.0, 8.5, 3.9])
    out = capsys.readouterr().out
    assert re.search(r"^eager \(original\) +8\.800 +1\.00x +0\.0e\+00$", out, re.MULTILINE), out
    assert re.search(r"^eager, fxkern rewritten +4\.000 +2\.20x +\S+$", out, re.MULTILINE), out
    assert re.search(r"^CUDA graph of the original +8\.500 +1\.04x +0\.0e\+00$", out, re.MULTILINE), out
    assert re.search(r"^CUDA graph of the rewritten +3\.900 +2\.26x +\S+$", out, re.MULTILINE), out
    assert "waits on the host" not in out  # eager within 10% of its CUDA graph: the GPU sets the pace


def test_demo_says_when_the_rewritten_forward_waits_on_the_host(monkeypatch, capsys):
    assert _time_demo(monkeypatch, [8.8, 5.0, 8.5, 4.0])
    out = capsys.readouterr().out
    assert "the rewritten forward waits on the host here: its kernels alone (the CUDA graph row) take 4.000 ms, " \
           "1.25x less than eager" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when no GPU is visible")
def test_demo_on_cuda_without_a_gpu_is_a_clear_error(capsys):
    assert cli.main(["demo", "--device", "cuda", "--rules", "test_cli:RULES"]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err


def test_demo_rejects_a_bad_hidden_size(capsys):
    assert cli.main(["demo", "--device", "cpu", "--hidden", "30", "--rules", "test_cli:RULES"]) == 2
    assert "not a multiple of the head size" in capsys.readouterr().err


# ---- explain --------------------------------------------------------------------------------


def test_explain_prints_the_matches_of_a_saved_program(saved_tiny, capsys):
    assert cli.main(["explain", str(saved_tiny), "--rules", "test_cli:RULES"]) == 0
    out = capsys.readouterr().out
    assert "rule swiglu: 2 replaced" in out
    assert "demo.py:" in out and "2 replaceable" in out


DEFAULT_SET = """
import sys, fxkern, torch.nn.functional as F
from fxkern import cli
sys.path.insert(0, {tests!r})
from helpers import spec_like
def cli_default_swiglu(a, b):
    return F.silu(a) * b
fxkern.replace(cli_default_swiglu, spec_like(cli_default_swiglu), name="fxkern_test_cli_default::cli_default_swiglu")
sys.exit(cli.main(["explain", {path!r}]))
"""


def test_explain_with_the_default_rules(saved_tiny):
    """No --rules: the library's rules, then the default rule set (what the user's modules added)."""
    code = DEFAULT_SET.format(tests=str(ROOT / "tests"), path=str(saved_tiny))
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rule cli_default_swiglu:" in proc.stdout  # from the default rule set, after the library's
    # the same SwiGLUs: one rule wins each (priority, then creation order), the other reports the overlap
    won = sum(int(n) for n in re.findall(r"^rule (?:cli_default_)?swiglu: (\d+) replaced", proc.stdout, re.MULTILINE))
    assert won == 2 and "overlap lost to rule" in proc.stdout
    assert "replaceable" in proc.stdout


def raising_rules():
    raise RuntimeError("the rules need a GPU")


@pytest.fixture
def broken_module(tmp_path, monkeypatch):
    """A --rules or --import module whose own code fails at import."""
    (tmp_path / "cli_broken_module_xyz.py").write_text("RULES = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("test_cli", "expected MODULE:ATTR"),
        ("no_such_module_xyz:RULES", "cannot import module 'no_such_module_xyz'"),
        ("test_cli:NOPE", "has no attribute 'NOPE'"),
        ("test_cli:RULES.nope", "module 'test_cli''s RULES (RuleSet) has no attribute 'nope'"),  # named 'RULES.nope
        ("test_cli:ROOT", "is a PosixPath, not a fxkern.RuleSet"),
        ("test_cli:not_rules", "is a list, not a fxkern.RuleSet"),
        ("test_cli:swiglu", "calling it without arguments failed"),
        ("test_cli:raising_rules", "calling it raised RuntimeError: the rules need a GPU"),  # was a traceback
        ("cli_broken_module_xyz:RULES", "importing 'cli_broken_module_xyz' raised ZeroDivisionError"),
    ],
)
def test_explain_bad_rules_is_a_clear_error(saved_tiny, capsys, rules, message, broken_module):
    assert cli.main(["explain", str(saved_tiny), "--rules", rules]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxkern explain: error: ") and message in err
    assert "Traceback" not in err


def test_explain_import_that_fails_is_a_clear_error(saved_tiny, capsys, broken_module):
    assert cli.main(["explain", str(saved_tiny), "--import", "cli_broken_module_xyz", "--rules", "test_cli:RULES"]) == 2
    err = capsys.readouterr().err
    assert "--import 'cli_broken_module_xyz': ZeroDivisionError" in err and "Traceback" not in err


def test_explain_missing_or_bad_file(tmp_path, capsys):
    assert cli.main(["explain", str(tmp_path / "nope.pt2"), "--rules", "test_cli:RULES"]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.pt2"
    bad.write_text("not a program")
    assert cli.main(["explain", str(bad), "--rules", "test_cli:RULES"]) == 2
    err = capsys.readouterr().err
    assert "cannot load it as an ExportedProgram" in err and "Traceback" not in err


def test_explain_names_an_op_nobody_registered(tmp_path, capsys):
    """A rewritten program calls an fxkern op: loading it needs the module that registers it."""
    cfg = demo.SIZES["tiny"]
    model = demo.build_model(cfg, torch.device("cpu"), torch.float32)
    ep = fxkern.apply(torch.export.export(model, (torch.randint(0, cfg.vocab, (2, 16)),)), RULES)
    path = tmp_path / "rewritten.pt2"
    torch.export.save(ep, str(path))
    # in a fresh process nothing registers fxkern_test_cli::swiglu
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fxkern", "explain", str(path), "--rules", "fxkern:default_rules"],
                          check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert "calls torch.ops.fxkern_test_cli.swiglu" in proc.stderr and "--import" in proc.stderr


def test_explain_loads_a_program_the_library_rewrote(tmp_path):
    """Importing fxkern.library registers nothing, so --import fxkern.library, which the error
    suggested, could not load such a program (found by a probe): explain registers the library."""
    import fxkern.library

    cfg = demo.SIZES["tiny"]
    model = demo.build_model(cfg, torch.device("cpu"), torch.float32)
    ep = fxkern.apply(torch.export.export(model, (torch.randint(0, cfg.vocab, (2, 16)),)), fxkern.library.rules())
    path = tmp_path / "library.pt2"
    torch.export.save(ep, str(path))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "fxkern", "explain", str(path), "--rules", "fxkern:default_rules"],
                          check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"library\.pt2: \d+ nodes; rule set 'default'", proc.stdout), proc.stdout


def test_explain_names_the_module_a_model_output_type_needs(tmp_path):
    """A model returning a pytree type (transformers' CausalLMOutputWithPast) loads only where its
    module is imported: explain said only "not registered" (found by a usability test)."""
    (tmp_path / "cli_out_xyz.py").write_text(textwrap.dedent("""
        import dataclasses, torch

        @dataclasses.dataclass
        class Out:
            logits: torch.Tensor

        torch.utils._pytree.register_dataclass(Out, serialized_type_name="cli_out_xyz.Out")

        class Model(torch.nn.Module):
            def forward(self, x):
                return Out(x * 2)
    """))
    save = "import sys, torch, cli_out_xyz; torch.export.save(torch.export.export(cli_out_xyz.Model(), (torch.ones(2),)), sys.argv[1])"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    path = tmp_path / "out.pt2"
    subprocess.run([sys.executable, "-c", save, str(path)], check=True, env=env, timeout=300, cwd=tmp_path)
    explain = [sys.executable, "-m", "fxkern", "explain", str(path)]
    proc = subprocess.run(explain, check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and "returns cli_out_xyz.Out" in proc.stderr, proc.stderr
    assert "pass --import cli_out_xyz" in proc.stderr
    proc = subprocess.run(explain + ["--import", "cli_out_xyz"], check=False, capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_no_command_prints_usage(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err


def test_the_installed_script_imports_rules_from_the_working_directory(saved_tiny, tmp_path):
    """`fxkern explain ... --rules myrules:RULES` from the directory holding myrules.py, as
    `python -m fxkern` does (the script's sys.path starts at its own directory; found by a review)."""
    script = Path(sys.executable).with_name("fxkern")
    if not script.exists():
        pytest.skip("the fxkern script is not installed in this environment (pip install -e . makes it)")
    (tmp_path / "cwd_rules_xyz.py").write_text("import fxkern\nRULES = fxkern.RuleSet('cwd')\n")
    proc = subprocess.run([str(script), "explain", str(saved_tiny), "--rules", "cwd_rules_xyz:RULES"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "rule set 'cwd'" in proc.stdout
