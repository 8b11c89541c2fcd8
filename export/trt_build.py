"""TensorRT engines for an exported directory: a build plan (pure Python) and the build.

`build_plan` turns a manifest plus the user's limits into everything the build needs: per
graph the engine file and its optimization profiles with exact (min, opt, max) shapes. It
imports no TensorRT and is unit-tested (tests/test_trt_plan.py). Precision is the export's
dtype (strongly typed networks only; TensorRT 11 has no other kind).

`build_engines` builds through Polygraphy's loaders: NetworkFromOnnxPath (the ONNX parser,
external weights resolved next to the file), CreateConfig (profiles, workspace limit, the
timing cache, a progress monitor), EngineBytesFromNetwork (build, and merge the timing cache
back into its file under a lock) and SaveBytes. Written by hand, because Polygraphy does
not do them: the profiles (runtime/profiles.py), the all-or-nothing swap of
OUT/engines, the manifest record, the rich progress bars and one-line errors.

NOT EXECUTED ON TENSORRT HARDWARE IN DEVELOPMENT: a build needs TensorRT's libraries and an
NVIDIA GPU, which the development machines do not have. Here it runs real Polygraphy against a
double of the real TensorRT 10.12 and 11.4 Python bindings (tests/trt_double.py: names,
signatures, types and return values are NVIDIA's; the build itself is simulated); on a GPU
machine, tests/test_trt_gpu.py builds for real.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..runtime.contract import BATCH, GRAPH_FILES, GRAPHS, ring
from ..runtime.manifest import Manifest, load_manifest, write_manifest
from ..runtime.errors import DFlashError
from ..runtime.lazy import lazy_import
from ..runtime.outdir import commit, staged
from ..runtime.profiles import Limits, check_precision, profile_record, resolve_limits
from ..runtime.trt.engines import (
    ENGINE_DIR, ENGINE_FILES, gpu_info, import_tensorrt, refuse_quantized, trt_version_tuple,
)

# polygraphy (the trt extra) and the lint (onnx): on first use (runtime/lazy.py)
pcommon = lazy_import("polygraphy.backend.common")
ptrt = lazy_import("polygraphy.backend.trt")
pexception = lazy_import("polygraphy.exception")
plogger = lazy_import("polygraphy.logger")
trt_lint = lazy_import("dflash_export.export.trt_lint")



@dataclass
class GraphPlan:
    graph: str
    onnx: str  # relative to OUT
    engine: str  # relative to OUT
    profiles: list[dict]  # [{name, ranges, shapes: {input: [min, opt, max]}}], index = TensorRT profile index


@dataclass
class BuildPlan:
    precision: str  # always the export's dtype
    workspace_bytes: int
    limits: Limits
    graphs: list[GraphPlan] = field(default_factory=list)


def default_timing_cache() -> Path:
    """Timing cache shared by every build on this machine (TensorRT keys entries by device and version)."""
    base = os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-export"
    return Path(base) / "trt-timing.cache"


def build_plan(manifest: Manifest, precision: str | None = None, max_context: int | None = None,
               max_prompt: int | None = None, workspace_gb: float = 4.0, max_batch: int = 1) -> BuildPlan:
    """The whole build decided from the manifest; raises DFlashError on impossible requests."""
    refuse_quantized(manifest)
    if getattr(manifest, "windowed", None):  # its sliding layers' rings are host arrays (runtime/window.py)
        raise DFlashError(f"TensorRT engines for {manifest.architecture} targets (sliding-window layers with ring caches) "
                          "are not built in this version; run this export with ONNX Runtime (--backend ort)")
    if (manifest.moe or {}).get("path") == "op":
        raise DFlashError(f"this export is {trt_lint.MOE_OP}")
    if ring(manifest):  # the TensorRT backend writes a drafter context slot per position
        raise DFlashError(f"this export keeps its drafter context in a ring of {ring(manifest)} slots (every drafter "
                          "layer slides), which the TensorRT backend does not run yet; re-export with --max-context "
                          f"<= {ring(manifest)} (a slot per position) or run it with ONNX Runtime (--backend ort)")
    precision = check_precision(manifest.dtype, precision)
    if not workspace_gb > 0:
        raise DFlashError(f"--workspace {workspace_gb}: give the builder's workspace in GB, > 0")
    limits = resolve_limits(manifest, max_context, max_prompt, max_batch)
    record = profile_record(manifest, limits)
    return BuildPlan(
        precision=precision,
        workspace_bytes=int(workspace_gb * (1 << 30)),
        limits=limits,
        graphs=[GraphPlan(g, GRAPH_FILES[g], ENGINE_FILES[g], record[g]) for g in GRAPHS],
    )


def describe(plan: BuildPlan) -> str:
    """Human-readable plan (printed by `build --dry-run` and before a build)."""
    lim = plan.limits
    lines = [
        f"precision {plan.precision} (strongly typed: the export's types), "
        f"block {lim.block_size}, max context {lim.max_context}, max prompt {lim.max_prompt}, "
        f"batch 1..{lim.max_batch}, workspace {plan.workspace_bytes / (1 << 30):g} GB"
    ]
    for g in plan.graphs:
        for i, p in enumerate(g.profiles):
            rng = ", ".join(f"{r} {a}..{c} (opt {b})" for r, (a, b, c) in p["ranges"].items() if r != BATCH)
            lines.append(f"  {g.engine}  profile {i} {p['name']}: {rng}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The build (needs TensorRT + GPU; not executed against TensorRT in development)
# ---------------------------------------------------------------------------------------


def _progress_monitor(trt, console):
    """A trt.IProgressMonitor that shows the builder's phases as rich progress bars."""
    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.lock = threading.Lock()  # TensorRT may call from several threads
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
            self.tasks = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            with self.lock:
                depth = 0 if parent_phase is None else 1
                self.tasks[phase_name] = self.bars.add_task("  " * depth + phase_name, total=max(num_steps, 1))

        def step_complete(self, phase_name, step):
            with self.lock:
                if phase_name in self.tasks:
                    self.bars.update(self.tasks[phase_name], completed=step + 1)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            with self.lock:
                task = self.tasks.pop(phase_name, None)
                if task is not None:
                    self.bars.remove_task(task)

    return Monitor()


def polygraphy_loaders(trt, out: Path, g: GraphPlan, plan: BuildPlan, timing_cache: Path, dest: Path, monitor=None):
    """The Polygraphy loader chain that parses g.onnx, builds its engine and writes it to `dest`.

    Calling the returned loader runs the build. The STRONGLY_TYPED network flag is set on
    TensorRT 10.x only: there it is what makes the build honour the graph's types; 11.x
    deprecated the flag (always strongly typed) and may drop it, and Polygraphy would then
    fail on the missing attribute. (The flag's number differs: 1 on 10.x, where EXPLICIT_BATCH
    is 0; 0 on 11.x. Polygraphy reads it from the installed module.)

    TF32 stays off (Polygraphy clears it unless asked): an fp32 export is the parity
    reference (1e-4 against PyTorch), which TF32's 10-bit mantissa would not keep; for
    speed, export fp16 or bf16.
    """
    network = ptrt.NetworkFromOnnxPath(str(out / g.onnx), strongly_typed=trt_version_tuple(trt.__version__) < (11, 0))
    profiles = []
    for p in g.profiles:
        prof = ptrt.Profile()
        for name, (lo, opt, hi) in p["shapes"].items():
            prof.add(name, min=tuple(lo), opt=tuple(opt), max=tuple(hi))
        profiles.append(prof)
    config = ptrt.CreateConfig(profiles=profiles, memory_pool_limits={trt.MemoryPoolType.WORKSPACE: plan.workspace_bytes},
                          load_timing_cache=str(timing_cache), progress_monitor=monitor)
    return pcommon.SaveBytes(ptrt.EngineBytesFromNetwork(network, config, save_timing_cache=str(timing_cache)), str(dest))


def build_engines(out_dir: str | Path, precision: str | None = None, max_context: int | None = None,
                  max_prompt: int | None = None, timing_cache: str | Path | None = None,
                  workspace_gb: float = 4.0, progress: bool = True, echo=print, max_batch: int = 1) -> Manifest:
    """Build OUT/engines/*.engine and record them in OUT's manifest; all or nothing."""
    trt, cudart = import_tensorrt()  # first: without TensorRT nothing else happens
    try:  # polygraphy is probed here, after TensorRT
        G_LOGGER, PolygraphyException = plogger.G_LOGGER, pexception.PolygraphyException
    except ImportError:
        raise DFlashError('the TensorRT build needs polygraphy: pip install "dflash-export[trt]"') from None
    out = Path(out_dir)
    manifest = load_manifest(out)
    if manifest.attention == "ort":
        raise DFlashError(f"{out}: {trt_lint.ORT_FLAVOUR}")
    plan = build_plan(manifest, precision, max_context, max_prompt, workspace_gb, max_batch)
    try:
        cc, gpu = gpu_info(cudart)
    except DFlashError as e:
        raise DFlashError(f"no usable NVIDIA GPU for the TensorRT build ({e})") from None
    if plan.precision == "bf16" and tuple(int(x) for x in cc.split(".")) < (8, 0):
        raise DFlashError(f"bf16 engines need compute capability >= 8.0; this GPU ({gpu}) is {cc}: "
                          "re-export with --dtype fp16")
    for w in trt_lint.check(out, manifest, trt.__version__, plan.limits):
        echo(f"warning: {w}")
    echo(describe(plan))

    cache_path = Path(timing_cache) if timing_cache else default_timing_cache()
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    if not cache_path.exists():
        cache_path.write_bytes(b"")  # an empty cache is a valid start; spares Polygraphy's "not found" warning
    G_LOGGER.colors = False  # else Polygraphy asks for the optional `colored` package
    console = None
    if progress:
        console = Console(stderr=True)
    with staged(out, "engines", say=echo) as staging:  # beside OUT; removed unless published, Ctrl-C too
        for i, g in enumerate(plan.graphs, 1):
            t0 = time.perf_counter()
            monitor = _progress_monitor(trt, console) if progress else None
            dest = staging / Path(g.engine).name
            if monitor is not None:
                monitor.bars.start()
            try:
                with G_LOGGER.verbosity(G_LOGGER.WARNING):  # Polygraphy's INFO lines would bury ours
                    polygraphy_loaders(trt, out, g, plan, cache_path, dest, monitor)()
            except PolygraphyException as e:
                first = (str(e).strip().splitlines() or ["see the log above"])[0]
                raise DFlashError(f"TensorRT could not build an engine for {g.onnx}: {first}") from None
            finally:
                if monitor is not None:
                    monitor.bars.stop()
            echo(f"[{i}/{len(plan.graphs)}] {g.engine}: {dest.stat().st_size / 2**20:.1f} MiB "
                 f"in {time.perf_counter() - t0:.1f} s")
        commit(staging, out, ENGINE_DIR)  # all engines built: swap them in, then re-hash so the manifest covers them
    manifest.engines = {
        "tensorrt": trt.__version__,
        "compute_capability": cc,
        "gpu": gpu,
        "precision": plan.precision,
        "block_size": plan.limits.block_size,
        "max_context": plan.limits.max_context,
        "max_prompt": plan.limits.max_prompt,
        "max_batch": plan.limits.max_batch,
        "workspace_bytes": plan.workspace_bytes,
        "files": {g.graph: g.engine for g in plan.graphs},
        "profiles": {g.graph: g.profiles for g in plan.graphs},
    }
    write_manifest(out, manifest)
    echo(f"engines written to {out / ENGINE_DIR}; timing cache {cache_path}")
    return manifest
