"""How fast training can go on this machine: precision chosen by measurement, and the FLOP count.

bf16 autocast is 2-3x faster than fp32 on CPUs with native bf16 (AVX512-BF16, AMX) and
10-16x *slower* on CPUs without it (AVX2 only: one LM-head matmul took 4.1 s in bf16 vs
0.25 s in fp32). So `auto` times both on the shapes the run will use, once per machine and
shape (cached in ~/.cache/dflash-export/precision.json), and picks the faster.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from ..runtime.errors import DFlashError

PRECISIONS = ("fp32", "bf16", "auto")


def cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-export" / "precision.json"


def machine_id() -> str:
    """CPU model + flags (a bf16-capable and an AVX2-only CPU must not share a cache entry)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in info:
                info[key.strip()] = val.strip()
    except OSError:
        pass
    text = f"{platform.machine()}|{info.get('model name', platform.processor())}|{info.get('flags', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _best_of(fns: dict, reps: int = 3) -> dict:
    """Seconds per call of each fn: warm up once, then interleaved reps, the minimum (shared CPUs are noisy)."""
    best = {}
    for name, fn in fns.items():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    return best


def lm_head_probe(rows: int, hidden: int, vocab: int, bf16: bool) -> None:
    """The training step's largest matmul: LM head forward + input gradient (the head is frozen)."""
    x = torch.randn(rows, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden) * 0.02
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = F.linear(x, w)
    y.float().sum().backward()


def choose(kind: str, requested: str, shape: str, probe, log=print) -> str:
    """'fp32' or 'bf16' for `kind` ('training' / 'generation'): as requested, or the faster one measured.

    `probe(bf16: bool)` runs one representative call; the result is cached per machine, torch
    version, thread count and `shape`, so the measurement runs once.
    """
    if requested not in PRECISIONS:
        raise DFlashError(f"--train-precision must be one of {', '.join(PRECISIONS)} (got {requested!r})")
    if requested != "auto":
        log(f"precision ({kind}): {requested} (as requested)")
        return requested
    key = f"{kind}|{machine_id()}|torch {torch.__version__}|threads {torch.get_num_threads()}|{shape}"
    path = cache_file()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    hit = key in table
    if not hit:
        t = _best_of({"fp32": lambda: probe(False), "bf16": lambda: probe(True)})
        table[key] = {k: round(v * 1000, 2) for k, v in t.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1) + "\n")
            tmp.replace(path)
        except OSError:
            pass  # a read-only home only costs a re-probe next time
    ms = table[key]
    pick = "bf16" if ms["bf16"] < ms["fp32"] else "fp32"
    log(f"precision ({kind}): {pick}, the faster here: fp32 {ms['fp32']:.1f} ms vs bf16 autocast "
        f"{ms['bf16']:.1f} ms per {shape} ({'cached' if hit else 'measured now'}; "
        f"--train-precision / --gen-precision to force)")
    return pick


def step_flops(n_seq: int, seq_len: int, n_blocks: int, block: int, hidden: int, vocab: int, n_taps: int,
               layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, mean_keys: float) -> float:
    """Forward + backward FLOPs of one training step (the target's features excluded: they are cached).

    - LM head over the supervised positions, forward + input gradient: 4*H*V each;
    - drafter layers over every block position, forward + both gradients: 6 * params + 12*heads*D*keys;
    - context projection (fc + each layer's k/v) over every sequence position: 6 * params.
    """
    supervised = n_blocks * (block - 1)
    layer_params = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    per_block_pos = layers * (6 * layer_params + 12 * heads * head_dim * mean_keys)
    ctx = n_seq * seq_len * 6 * (n_taps * hidden * hidden + layers * 2 * hidden * kv_heads * head_dim)
    return supervised * 4 * hidden * vocab + n_blocks * block * per_block_pos + ctx
