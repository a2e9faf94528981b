"""Whether a change to fxkern.library's kernel sources changes their machine code, on a machine
with no GPU:

    python tools/same_sass.py [BASE]          (BASE: a git revision; default HEAD)

Registers every op of the library in BASE and in the working tree (each in its own process: NVRTC
compiles each kernel for sm_90, or $FXKERN_ARCH, as registration does), disassembles every kernel
of every op with nvdisasm (the ``nvidia-cuda-nvdisasm`` wheel, a test extra, found through
cuda.pathfinder) and compares their instructions, addresses and branch targets' numbers aside. A
cleanup whose every kernel is the same code needs no GPU run to show it changed nothing the GPU
does; one whose code changed does. Prints one line per op whose code differs, or that only one tree
has, and a count; exit status 0 when every kernel is the same, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run inside each tree (its fxkern on sys.path): register the library, write each op's CUBIN.
_DUMP = """
import sys
from pathlib import Path
import fxkern.library
from fxkern import ops
fxkern.library.rules()
out = Path(sys.argv[1])
for entry in ops.registered_ops():
    if entry.qualname.startswith("fxkern_lib::") and entry.compiled is not None:
        (out / (entry.qualname.replace("::", "__") + ".cubin")).write_bytes(entry.compiled.cubin)
"""


def nvdisasm() -> str:
    """The nvdisasm binary: the ``nvidia-cuda-nvdisasm`` wheel's or a CUDA toolkit's, else an error
    that says how to get one."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvdisasm")
    except Exception:  # pathfinder's errors differ between versions
        found = None
    if not found:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (in fxkern's test extras)")
    return found


def functions(cubin: bytes, tool: str) -> dict[str, list[str]]:
    """Each kernel of ``cubin`` by its (mangled) name: its instructions as text, without addresses
    or encodings, and with branch targets' label numbers renamed in order of appearance (a kernel
    whose code moved within the file reads the same)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, f.name], check=True, capture_output=True, text=True).stdout
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    labels: dict[str, str] = {}
    for line in text.splitlines():
        head = re.match(r"\s*\.text\.(\S+):", line)
        if head:
            current, labels = out.setdefault(head.group(1), []), {}
            continue
        if current is None or ";" not in line:
            continue
        code = re.sub(r"/\*.*?\*/", "", line).strip()
        code = re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), code)
        current.append(" ".join(code.split()))
    return out


def kernel_name(mangled: str) -> str:
    """``softmax_last<__nv_bfloat16>`` for ``_Z12softmax_lastI13__nv_bfloat16EvPKT_iiPS1_``: the
    kernel and its first template argument, enough to tell a library op's instantiations apart."""
    m = re.match(r"_Z(\d+)", mangled)
    if not m:
        return mangled
    start = m.end()
    name, rest = mangled[start:start + int(m.group(1))], mangled[start + int(m.group(1)):]
    if not rest.startswith("I"):
        return name
    arg = re.match(r"(\d+)", rest[1:])
    if arg:
        first = rest[1 + arg.end():1 + arg.end() + int(arg.group(1))]
    else:
        first = {"f": "float", "d": "double", "i": "int"}.get(rest[1:2], rest[1:2])
    return f"{name}<{first}>"


def dump(tree: Path, out: Path) -> None:
    """Each library op's CUBIN as ``tree``'s fxkern compiles it, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-c", _DUMP, str(out)], cwd=tree, env=env, check=True)


def compare(base: Path, new: Path, tool: str) -> list[str]:
    """One line per op whose kernels differ between the CUBINs in ``base`` and ``new`` (or that
    one of them lacks); nothing for ops whose every kernel is the same code."""
    lines = []
    for name in sorted({p.name for p in base.glob("*.cubin")} | {p.name for p in new.glob("*.cubin")}):
        op = name.removesuffix(".cubin").replace("__", "::", 1)
        a, b = base / name, new / name
        if not a.exists() or not b.exists():
            lines.append(f"{op}: only in {'the working tree' if b.exists() else 'BASE'}")
            continue
        fa, fb = functions(a.read_bytes(), tool), functions(b.read_bytes(), tool)
        changed = [f"{kernel_name(k)} ({len(fa.get(k, []))} -> {len(fb.get(k, []))} instructions)"
                   for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
        if changed:
            lines.append(f"{op}: differs in " + ", ".join(changed))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="?", default="HEAD", help="git revision to compare with (default HEAD)")
    args = parser.parse_args(argv)
    tool = nvdisasm()
    with tempfile.TemporaryDirectory(prefix="fxkern-same-sass-") as tmp:
        tmp = Path(tmp)
        base_tree = tmp / "base"
        base_tree.mkdir()
        archive = subprocess.run(["git", "archive", args.base, "fxkern"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive.stdout, check=True)
        dump(base_tree, tmp / "cubin_base")
        dump(ROOT, tmp / "cubin_new")
        lines = compare(tmp / "cubin_base", tmp / "cubin_new", tool)
        total = len(list((tmp / "cubin_new").glob("*.cubin")))
    for line in lines:
        print(line)
    print(f"{total - len(lines)} of {total} library ops compile to the same code as {args.base}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
