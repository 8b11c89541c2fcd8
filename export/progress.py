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
        """Yields a `Bar` for phases that go tensor by tensor (the status line shows it)."""
        t0 = time.perf_counter()
        with self.console.status(f"[bold]{name}[/] {what}") as status:
            yield Bar(status, f"[bold]{name}[/] {what}")  # .update(text), or .start/.advance: a bar
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


class Bar:
    """A phase's status line as a bar over bytes with an ETA: `advance(nbytes, item)` per tensor
    written, after `start(total)`; on a big export the save takes minutes."""

    WIDTH = 24

    def __init__(self, status, label: str):
        self.status, self.label, self.total, self.done, self.t0 = status, label, 0, 0, time.perf_counter()

    def update(self, *args, **kwargs) -> None:
        self.status.update(*args, **kwargs)

    def start(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def advance(self, nbytes: int, item: str) -> None:
        if not self.total:
            return
        self.done += nbytes
        frac = min(1.0, self.done / self.total)
        spent = time.perf_counter() - self.t0
        eta = f"ETA {_clock(spent * (1 - frac) / frac)}" if frac > 0.02 and spent > 1 else "ETA ..."
        full = int(frac * self.WIDTH)
        self.status.update(f"{self.label} [{'#' * full}{'-' * (self.WIDTH - full)}] {frac:4.0%} "
                           f"{human(self.done)} / {human(self.total)} {eta}  {item}")


def _clock(s: float) -> str:
    return f"{int(s // 60)} min {int(s % 60):02d} s" if s >= 60 else f"{int(s)} s"
