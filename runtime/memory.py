"""What the caches of a batch cost, and whether this machine has it: checked at load, so a
--batch x max context that cannot fit is refused in one line instead of swapping or being
killed half-way through a generation."""

from __future__ import annotations

from pathlib import Path

from . import contract as C
from .errors import DFlashError


def available_memory(root: Path = Path("/")) -> int | None:
    """Bytes this process can still take: MemAvailable, capped by the memory limit of every cgroup
    above it (v2 memory.max, v1 memory.limit_in_bytes, less what each uses); None: unknown.
    `root`: where /proc and /sys are (tests give a fake tree)."""
    avail = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    room = cgroup_room(root)
    return avail if room is None or avail is None else min(avail, room)


def cgroup_room(root: Path = Path("/")) -> int | None:
    """The tightest cgroup memory limit less its usage, over this process's cgroup and its parents
    (a container's limit is often set one level up); None when no limit is set or readable."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = ["0::/"]
    room = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            base, files = root / "sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base, files = root / "sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = base.joinpath(*parts[:depth])
            try:
                limit = (d / files[0]).read_text().strip()
                if limit == "max" or int(limit) >= 1 << 60:  # v1's "no limit" is about 2^63
                    continue
                left = int(limit) - int((d / files[1]).read_text())
            except (OSError, ValueError):
                continue
            room = left if room is None else min(room, left)
    return None if room is None else max(room, 0)


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


PACKING = 1.06  # ONNX Runtime's packed weights vs their bytes on disk (MatMulNBits at accuracy level 4 adds a sum per block)
WORK_PER_POSITION = 256  # bytes of working memory per prefill position and unit of hidden size (see run_memory)
RUNTIME_BASE = 150 << 20  # Python, numpy, ONNX Runtime and the tokenizer, loaded, before any weight


def run_memory(directory: str | Path, m, *, drafter: bool = True, chunk: int = 256, rows: int = 1) -> dict:
    """About how many bytes a run of `directory` holds, by part (`info` prints it; docs/real-sizes.md
    compares it with measured peaks). ONNX Runtime reads each weight from the graph's data file,
    packs it into its own buffer and frees what it read, so the weights are held once; but a
    weight several graphs share (shared.data: the LM head, the drafter's K/V projections) is
    packed once per session that holds it, while the embedding table is read in place from the
    mapped file (only the rows a prompt uses are resident). Working memory (ONNX Runtime's arena)
    grows with the prefill chunk: measured about 0.9 MiB per position at hidden 4096
    (WORK_PER_POSITION x hidden bytes per position). The KV cache is counted at max context: its
    pages become resident as a sequence grows into them."""
    directory = Path(directory)
    graphs = [C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK] if drafter else [C.TARGET]
    size = lambda rel: (directory / rel).stat().st_size if (directory / rel).is_file() else 0  # noqa: E731
    own = sum(size(m.graphs[g].file) + size(Path(m.graphs[g].file).with_suffix(".data")) for g in graphs)
    regions: dict[tuple, int] = {}
    for name, t in m.shared.items():
        holders = [g for g in t.graphs if g in graphs]
        packed = 0 if name.startswith(C.SHARED_INITIALIZERS[0]) else len(holders)  # the lookup reads in place
        key = (t.file, t.offset)
        regions[key] = max(regions.get(key, 0), packed * t.length)  # a tied head: the table's bytes, packed per graph
    shared = sum(regions.values())
    weights = int((own + shared) * PACKING)
    kv = rows * m.max_context * cache_bytes_per_position(m, drafter) + rows * ring_bytes(m)
    work = chunk * WORK_PER_POSITION * m.hidden_size
    return {"weights": weights, "kv_cache": kv, "work": work, "runtime": RUNTIME_BASE,
            "total": weights + kv + work + RUNTIME_BASE, "chunk": chunk, "max_context": m.max_context}


def human(n: float) -> str:
    """Bytes for people: "512 B", "1.5 MiB", "3.2 GiB" (info's file table, the exporter's sizes and peak RSS)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
