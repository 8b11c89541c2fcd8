"""The layering rule, checked on the source: imports point one way (runtime <- models/serve <- export/train <- CLI),
no cycles among the package's modules (imports inside functions count), optional dependencies only where declared."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from dflash_export.runtime.lazy import EXTRAS, HEAVY

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"dflash_export": "dflash_export", "dflash_export.models": "models", "dflash_export.export": "export",
            "dflash_export.runtime": "runtime", "dflash_export.serve": "serve", "dflash_export.train": "train",
            "dflash_export.demo": "demo"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in (ROOT / folder).glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


MODULES = modules()


def imports(name: str, top_only: bool = False) -> set[str]:
    """Absolute names `name` imports: our modules (a `from . import x` names x, not the package) and
    third-party top-level packages. top_only: module-level statements only (not inside functions)."""
    f = MODULES[name]
    base = name.split(".") if f.stem == "__init__" else name.split(".")[:-1]
    tree = ast.parse(f.read_text())
    nodes = tree.body if top_only else list(ast.walk(tree))
    if top_only:  # statements at module level, including inside if/try blocks there
        nodes = [n for stmt in tree.body for n in ast.walk(stmt)
                 if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + [node.module] if node.level else [node.module]) \
                if node.module else ".".join(base[: len(base) - node.level + 1])
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out |= set(subs) if len(subs) == len(node.names) else set(subs) | {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {n if n in MODULES or n.startswith("dflash_export") else n.split(".")[0] for n in out}


def test_no_import_cycles():
    graph = {m: {n for n in imports(m) if n in MODULES and n != m} for m in MODULES}
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_runtime_is_the_bottom_floor():
    """runtime/ (what an edge device installs) imports nothing above it and no torch or onnx."""
    for m in (m for m in MODULES if m.startswith("dflash_export.runtime")):
        bad = {n for n in imports(m) if n.startswith("dflash_export") and not n.startswith("dflash_export.runtime")}
        bad |= imports(m) & {"torch", "onnx", "onnxscript", "transformers", "fastapi", "ray"}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_serve_builds_on_runtime_alone():
    for m in (m for m in MODULES if m.startswith("dflash_export.serve")):
        bad = {n for n in imports(m) if n.startswith(("dflash_export.export", "dflash_export.models",
                                                     "dflash_export.train", "dflash_export.cmd"))}
        assert not bad and "torch" not in imports(m), f"{m} imports {sorted(bad)}"


def test_models_import_no_exporter_and_no_cli():
    for m in (m for m in MODULES if m.startswith(("dflash_export.models", "dflash_export.train"))):
        bad = {n for n in imports(m) if n.startswith(("dflash_export.export", "dflash_export.serve", "dflash_export.cmd"))}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_optional_dependencies_only_where_declared():
    """A module outside the declared heavy ones (runtime/lazy.py HEAVY) imports no optional dependency and
    no heavy module at its top: those go through lazy_import (or inside the function that needs them)."""
    heavy = lambda n: n in EXTRAS or n.startswith(HEAVY)  # noqa: E731
    for m in MODULES:
        if m.startswith(HEAVY):
            continue
        bad = {n for n in imports(m, top_only=True) if heavy(n)}
        assert not bad, f"{m} imports {sorted(bad)} at its top"


def test_generate_help_imports_neither_torch_nor_onnx():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom dflash_export.cli import cli\n"
            "r = CliRunner().invoke(cli, ['generate', '--help'])\nassert r.exit_code == 0, r.output\n"
            "print(sorted(m for m in ('torch', 'onnx', 'onnxscript', 'transformers', 'fastapi', 'ray') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
