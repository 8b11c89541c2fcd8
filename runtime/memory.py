"""What the caches of a batch cost, and whether this machine has it: checked at load, so a
--batch x max context that cannot fit is refused in one line instead of swapping or being
killed half-way through a generation."""

from __future__ import annotations

from pathlib import Path

from . import contract as C
from .errors import DFlashError


def available_memory() -> int | None:
    """Bytes this process can still take: MemAvailable, capped by a cgroup v2 limit (None: unknown)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and avail is not None:
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def cache_bytes_per_position(m, drafter: bool = True) -> int:
    """K and V of every attention layer of the target (and the drafter's context) for one position
    of one row (sliding layers keep a ring whatever the context: `ring_bytes`)."""
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
    cache = C.dtype((C.CACHE_KV if C.flavour(m) == "ort" else C.PAST_KV)[0], m)  # the ort flavour's: int8 when quantized
    attention = C.layer_kinds(C.TARGET, m).count(C.ATTENTION)
    per = 2 * attention * m.target_kv_heads * m.target_head_dim * size[cache]
    if drafter:
        per += 2 * m.draft_layers * m.draft_kv_heads * m.draft_head_dim * size[C.dtype(C.CTX_KV[0], m)]
    return per


def ring_bytes(m) -> int:
    """K and V of one row's rings (a sliding-window target's sliding layers), fixed in the context."""
    w = C.window(m)
    if not w:
        return 0
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[C.dtype(C.PAST_KV[0], m)]
    return 2 * C.layer_kinds(C.TARGET, m).count(C.SLIDING) * w["ring"] * w["kv_heads"] * w["head_dim"] * size


def check_cache_memory(m, max_batch: int, max_len: int, drafter: bool = True, available: int | None = None) -> int:
    """The bytes of max_batch rows of max_len positions (a batch > 1 also keeps one row's
    gathered copy for a joining row's prefill); refuses them when they exceed what is available."""
    rows = max_batch + (1 if max_batch > 1 else 0)
    need = rows * max_len * cache_bytes_per_position(m, drafter) + max_batch * ring_bytes(m)
    free = available_memory() if available is None else available
    if free is not None and need > free:
        gb = 1 << 30
        raise DFlashError(
            f"--batch {max_batch} x max context {max_len} needs {need / gb:.2f} GB of KV cache "
            f"({max_len * cache_bytes_per_position(m, drafter) / gb:.2f} GB a row) but {free / gb:.2f} GB of memory is "
            "available; lower --batch or re-export with a smaller --max-context")
    return need


def human(n: float) -> str:
    """Bytes for people: "512 B", "1.5 MiB", "3.2 GiB" (info's file table, the exporter's sizes and peak RSS)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
