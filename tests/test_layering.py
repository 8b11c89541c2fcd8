"""The layering rule, checked on the source: imports point one way (runtime <- models/serve <- export/train <- CLI),
no cycles among the package's modules (imports inside functions count), optional dependencies only where declared."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

from dflash_export.runtime.lazy import EXTRAS, HEAVY, LIGHT

ROOT = Path(__file__).resolve().parent.parent
# The package is the repository's top level (pyproject.toml): dflash_export.runtime.ort is runtime/ort/.
PACKAGES = ("dflash_export", "dflash_export.cli", "dflash_export.models", "dflash_export.export",
            "dflash_export.runtime", "dflash_export.runtime.ort", "dflash_export.runtime.trt",
            "dflash_export.serve", "dflash_export.train", "dflash_export.demo")
BOTTOM = ("dflash_export.runtime.errors", "dflash_export.runtime.lazy")  # below every layer: failures and the lazy importer


def folder(pkg: str) -> Path:
    return ROOT.joinpath(*pkg.split(".")[1:])


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in folder(pkg).glob("*.py"):
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
        if lazy(node) and not top_only:  # `x = lazy_import("dflash_export.y")`: an import all the same, on first use
            out.add(node.args[0].value)
        elif isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + [node.module] if node.level else [node.module]) \
                if node.module else ".".join(base[: len(base) - node.level + 1])
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out |= set(subs) if len(subs) == len(node.names) else set(subs) | {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {n if n in MODULES or n.startswith("dflash_export") else n.split(".")[0] for n in out}


def lazy(node) -> bool:
    """A call of the declared helper with a constant module name: `lazy_import("torch")`."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_import"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Constant))


# The only import statements inside functions: each probes whether an optional dependency is installed,
# where the helper's generic message would not do.
INNER_IMPORTS = {
    ("dflash_export.runtime.load", "ort_backend_class"): "onnxruntime or not: the hint names both flavours (cpu, gpu)",
    ("dflash_export.runtime.trt.engines", "import_tensorrt"): "tensorrt and cuda-python or not: one line names every missing package",
    ("dflash_export.cli.run", "plot_bench"): "matplotlib or not; matplotlib.use('Agg') must run before pyplot is imported",
}


def test_imports_at_the_top():
    """Imports are at the top of the file (optional dependencies through lazy_import), never inside a function,
    except the probes in INNER_IMPORTS: so a module's dependencies are read at its top."""
    found = {}
    for m, f in MODULES.items():
        def visit(node, fn):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)) and fn:
                    found.setdefault((m, fn), []).append(f"{f.relative_to(ROOT)}:{child.lineno} {ast.unparse(child)}")
                visit(child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn)
        visit(ast.parse(f.read_text()), None)
    bad = [line for key, lines in found.items() if key not in INNER_IMPORTS for line in lines]
    assert not bad, "imports inside functions (move them to the top; lazy_import for optional ones):\n" + "\n".join(bad)
    assert set(INNER_IMPORTS) <= set(found), f"stale INNER_IMPORTS entries: {sorted(set(INNER_IMPORTS) - set(found))}"


def _installed(name: str) -> bool | None:
    """Whether module `name` exists, found on disk without importing it; None: its package is not installed."""
    spec = importlib.util.find_spec(name.split(".")[0])  # a top-level name: nothing is imported
    if spec is None:
        return None
    paths = [Path(p) for p in spec.submodule_search_locations or []]
    for part in name.split(".")[1:]:
        pkgs = [d / part for d in paths if (d / part / "__init__.py").is_file()]
        if not pkgs:
            return any((d / f"{part}.py").is_file() or any(d.glob(f"{part}.*.so")) for d in paths) and part == name.split(".")[-1]
        paths = pkgs
    return True


def test_lazy_imports_name_real_modules():
    """Every lazy_import names a module that exists (a typo would otherwise fail only on first use)."""
    for m, f in MODULES.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if lazy(node):
                name = node.args[0].value
                ok = name in MODULES if name.startswith("dflash_export") else _installed(name) is not False
                assert ok, f"{m}: lazy_import({name!r}) names no module"


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
        bad = {n for n in imports(m) if n.startswith("dflash_export") and not n.startswith(("dflash_export.runtime", *BOTTOM))}
        bad |= imports(m) & {"torch", "onnx", "onnxscript", "transformers", "fastapi", "ray"}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_serve_builds_on_runtime_alone():
    for m in (m for m in MODULES if m.startswith("dflash_export.serve")):
        bad = {n for n in imports(m) if n.startswith(("dflash_export.export", "dflash_export.models",
                                                     "dflash_export.train", "dflash_export.cli"))}
        assert not bad and "torch" not in imports(m), f"{m} imports {sorted(bad)}"


def test_models_import_no_exporter_and_no_cli():
    for m in (m for m in MODULES if m.startswith(("dflash_export.models", "dflash_export.train"))):
        bad = {n for n in imports(m) if n.startswith(("dflash_export.export", "dflash_export.serve", "dflash_export.cli"))}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_optional_dependencies_only_where_declared():
    """A module outside the declared heavy ones (runtime/lazy.py HEAVY, less LIGHT) imports no optional dependency and
    no heavy module at its top: those go through lazy_import (or inside the function that needs them)."""
    heavy = lambda n: n in EXTRAS or (n.startswith(HEAVY) and n not in LIGHT)  # noqa: E731
    for m in MODULES:
        if heavy(m):
            continue
        bad = {n for n in imports(m, top_only=True) if heavy(n)}
        assert not bad, f"{m} imports {sorted(bad)} at its top"


def test_generate_help_imports_neither_torch_nor_onnx():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom dflash_export.cli import cli\n"
            "r = CliRunner().invoke(cli, ['generate', '--help'])\nassert r.exit_code == 0, r.output\n"
            "print(sorted(m for m in ('torch', 'onnx', 'onnxscript', 'transformers', 'fastapi', 'ray') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_bottom_modules_import_nothing_of_ours():
    for m in BOTTOM:
        assert {n for n in imports(m) if n.startswith("dflash_export")} <= set(BOTTOM), f"{m} imports our modules"


def test_relative_imports_resolve_by_path():
    """Every relative import names a module or package that exists by path from the file that makes it:
    what Pyright, code navigation and structure tools see, which run no import hooks."""
    bad = []
    for m, f in MODULES.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = f.parent.joinpath(*[".."] * (node.level - 1)).resolve()
                target = base.joinpath(*(node.module or "").split(".")) if node.module else base
                found = (target / "__init__.py").is_file() or target.with_suffix(".py").is_file()
                if found and not node.module:  # `from . import x`: each x a module or a name the package defines
                    found = all((target / f"{a.name}.py").is_file() or (target / a.name / "__init__.py").is_file()
                                or a.name in (target / "__init__.py").read_text() for a in node.names)
                if not found or ROOT not in [target, *target.parents]:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "relative imports that do not resolve by path:\n" + "\n".join(bad)


def test_package_imports_from_a_checkout():
    """`import dflash_export.cli` from the repository's top level, the checkout's own files (not an install)."""
    code = "import dflash_export, dflash_export.cli, dflash_export.runtime.loop as l; print(dflash_export.__file__, l.__file__)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    shim, loop = p.stdout.split()
    assert Path(shim) == ROOT / "dflash_export" / "__init__.py" and Path(loop) == ROOT / "runtime" / "loop.py", p.stdout


def test_backends_are_used_through_the_declared_interface():
    """No caller probes a backend (`hasattr(backend, ...)`, `getattr(backend, ..., default)`):
    what only some backends do is declared on runtime/backend.py's Backend and refused there."""
    probes = []
    for m, f in MODULES.items():
        if m.startswith("dflash_export.runtime.ort") or m.startswith("dflash_export.runtime.trt"):
            continue  # a backend's own attributes
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
                arg = node.args[0] if node.args else None
                name = arg.id if isinstance(arg, ast.Name) else arg.attr if isinstance(arg, ast.Attribute) else ""
                if name in ("backend", "be", "first") or name.endswith("_backend"):
                    probes.append(f"{f.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not probes, "backend probes (declare the attribute on Backend instead):\n" + "\n".join(probes)
