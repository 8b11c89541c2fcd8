"""The output directory of an export (or a quantization): checked before anything is written,
built in a temporary sibling, published whole. A failed or interrupted run leaves `--out` as it was."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..runtime import manifest as M
from ..errors import DFlashError


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"--out {out} exists and is not empty; pass --force to replace it or choose another path")
    if not out.parent.exists():
        raise DFlashError(f"the parent directory of --out {out} does not exist; create it first")


def write_manifest_checked(root: Path, manifest: M.Manifest) -> None:
    M.write_manifest(root, manifest)
    M.load_manifest(root, verify=True)  # what a runtime will do: must pass before we publish


def commit(tmp: Path, out: Path) -> None:
    """Move the finished directory onto `out` (replacing an old one only now)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
