"""An output directory (an export, a quantization, build's engines, train-draft's drafter):
checked before anything is written, built in a staging sibling, published whole. A failed or
interrupted run leaves it as it was.

`staged` is the one way a command writes one: a fresh sibling `.<out>.<kind>-<pid>`, removed
when the block ends unless `commit` published it. This file owns the siblings' names:
`partial` (an export's or a drafter's staging), `partial-q` (a quantization's: `export
--quantize` runs one inside its own export, so the two need different names), `engines`
(build's), `old` (the directory `commit` replaces, for a moment). A run that is killed (-9:
no cleanup runs) leaves its sibling; the next run on the same directory removes it
(`clean_stale`, which `staged` runs first).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from . import manifest as M
from .errors import DFlashError

KINDS = ("partial", "partial-q", "engines", "old")
STAGED = re.compile(r"(partial-q|partial|engines|old)-?(\d+)")  # "-?": partial-q<pid>, as quantize has always named it


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


def sibling(out: Path, kind: str) -> Path:
    """This process's `.<out>.<kind>-<pid>` (partial-q: `.<out>.partial-q<pid>`)."""
    if kind not in KINDS:
        raise ValueError(kind)
    sep = "" if kind == "partial-q" else "-"
    return out.parent / f".{out.name}.{kind}{sep}{os.getpid()}"


@contextmanager
def staged(out: Path, kind: str = "partial", say: Callable[[str], None] | None = None) -> Iterator[Path]:
    """A fresh, empty staging folder for `out`, removed when the block ends (by an error, Ctrl-C
    or normally) unless `commit` moved it onto `out`. What killed runs left beside `out` is
    removed first, each named to `say`."""
    for p in clean_stale(out):
        if say is not None:
            say(f"removed {p.name}, left by a run that did not finish")
    tmp = sibling(out, kind)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
            continue  # alive (a run going on now): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def commit(tmp: Path, out: Path, into: str | None = None) -> None:
    """Move the finished staging folder onto `out` (or onto `out/into`), replacing an old one
    only now; the old one waits beside `out` for that moment, never inside it."""
    dest = out if into is None else out / into
    old = None
    if dest.exists():
        old = sibling(out, "old")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
