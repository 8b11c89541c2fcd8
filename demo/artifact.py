"""The shipped demo pair (package data): where it lies, and its export, made once into the cache
(`serve --demo`, the benchmarks). torch is never imported here: the export runs in a child process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import click

from ..runtime import contract as C, manifest as M
from ..runtime.errors import DFlashError
from ..runtime.files import read_bytes
from ..runtime.lazy import installed

DEMO_CONTEXT = 2048


def demo_dir() -> Path:
    """The shipped demo data (pair/, prompts.jsonl): package data of dflash_export.demo."""
    return Path(str(resources.files("dflash_export.demo")))


def demo_cache_dir(pair: Path) -> Path:
    """Where the demo pair's export lives: keyed by the pair's content, the context and the artifact format."""
    files = sorted(p for p in pair.rglob("*") if p.is_file()) if pair.is_dir() else []
    if not files:
        raise DFlashError(f"the shipped demo pair is missing ({pair}); restore demo/pair/ or pass an exported directory")
    h = hashlib.sha256(f"{DEMO_CONTEXT}/{C.FORMAT_VERSION}".encode())  # a new artifact format: a new export
    for p in files:
        h.update(p.relative_to(pair).as_posix().encode() + hashlib.sha256(read_bytes(p)).digest())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-export"
    return cache / f"demo-{h.hexdigest()[:16]}"


def demo_artifact(pair: Path | None = None) -> Path:
    """The shipped demo pair exported once into ~/.cache/dflash-export/ (again when this version cannot read it)."""
    if pair is None:
        pair = demo_dir() / "pair"
    out = demo_cache_dir(pair)
    if (out / C.MANIFEST).is_file():
        try:
            M.load_manifest(out, verify=False)
            return out
        except DFlashError:  # unreadable by this version: export it again (--force)
            pass
    if not (installed("torch") and installed("onnx")):
        raise DFlashError('--demo exports the shipped pair once, which needs the export extra: '
                          'pip install "dflash-export[export]" (or serve an exported directory: dflash-export serve OUT)')
    click.echo(f"exporting the demo pair once into {out} (needs torch; the server itself does not) ...", err=True)
    out.parent.mkdir(parents=True, exist_ok=True)  # export wants an existing parent; a fresh machine has no cache yet
    cmd = [sys.executable, "-c", "from dflash_export.cli import main; main()", "export", "--target", str(pair / "target"),
           "--draft", str(pair / "draft"), "--out", str(out), "--max-context", str(DEMO_CONTEXT), "--quiet", "--force"]
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise DFlashError(f"exporting the demo pair failed: {last}")
    return out
