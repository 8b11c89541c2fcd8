"""The exporter's progress lines and the size table at the end (rich, on stderr)."""

from __future__ import annotations

import contextlib
import resource
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..runtime.memory import human


class Phases:
    """One status line per phase on stderr, then its time and the process's peak RSS so far
    (where memory goes on big models); silent when disabled."""

    def __init__(self, enabled: bool):
        self.console = Console(stderr=True, quiet=not enabled)

    @contextlib.contextmanager
    def phase(self, name: str, what: str):
        t0 = time.perf_counter()
        with self.console.status(f"[bold]{name}[/] {what}") as status:
            yield status  # status.update(text): progress within the phase
        rss = human(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
        self.console.print(f"[green]done[/] {name:<9} {what} ({time.perf_counter() - t0:.1f} s, peak RSS {rss})")


def report(ui: Phases, out: Path, seconds: float) -> None:
    """The files of a finished export and their sizes."""
    table = Table(title=f"{out} ({seconds:.1f} s)", title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    total = 0
    for p in sorted(out.iterdir()):
        total += p.stat().st_size
        table.add_row(p.name, human(p.stat().st_size))
    table.add_row("[bold]total", f"[bold]{human(total)}")
    ui.console.print(table)
