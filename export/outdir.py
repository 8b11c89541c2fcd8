"""The output directory of an export (or a quantization): checked before anything is written,
built in a staging sibling, published whole. A failed or interrupted run leaves `--out` as it was.

This file owns the siblings' names, `.<out>.<kind>-<pid>`: `partial` (an export's staging),
`partial-q` (a quantization's: `export --quantize` runs one inside its own export, so the two
need different names), `old` (the directory `commit` replaces, for a moment). A run that is
killed (-9: no cleanup) leaves its sibling; the next run on the same `--out` removes it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..runtime import manifest as M
from ..runtime.errors import DFlashError


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


KINDS = ("partial", "partial-q", "old")  # partial-q first matched as partial-q, not partial (see STAGED)
STAGED = re.compile(r"(partial-q|partial|old)-?(\d+)")  # "-?": partial-q<pid>, as quantize has always named it


def sibling(out: Path, kind: str) -> Path:
    """This process's `.<out>.<kind>-<pid>` (partial-q: `.<out>.partial-q<pid>`)."""
    if kind not in KINDS:
        raise ValueError(kind)
    sep = "" if kind == "partial-q" else "-"
    return out.parent / f".{out.name}.{kind}{sep}{os.getpid()}"


def staging(out: Path, kind: str = "partial") -> Path:
    """A fresh, empty staging folder for `out` (stale siblings of dead runs removed first: `clean_stale`)."""
    tmp = sibling(out, kind)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def clean_stale(out: Path) -> list[Path]:
    """Remove the siblings of `out` left by runs that were killed (their pid gone); a running
    one's folder is left alone. -> the removed paths."""
    removed = []
    for p in out.parent.glob(f".{out.name}.*"):
        m = STAGED.fullmatch(p.name[len(out.name) + 2 :])
        if m is None or int(m.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue  # alive (an export running now): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def commit(tmp: Path, out: Path) -> None:
    """Move the finished directory onto `out` (replacing an old one only now)."""
    old = None
    if out.exists():
        old = sibling(out, "old")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
