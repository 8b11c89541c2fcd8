"""TensorRT engines for an exported directory: a build plan (pure Python) and the build.

`build_plan` turns a manifest plus the user's limits into everything the build needs:
per graph the engine file and its optimization profiles with exact (min, opt, max)
shapes, the precision and whether the network can be strongly typed. It imports no
TensorRT and is unit-tested (tests/test_trt_plan.py).

`build_engines` runs the plan with the TensorRT 10 Python API (Builder, OnnxParser,
optimization profiles, workspace limit, a timing cache reused across builds, a progress
display), writes OUT/engines/*.engine and records them in the manifest.

NOT EXECUTED IN DEVELOPMENT: `build_engines` needs `tensorrt` and an NVIDIA GPU, which the
development machines do not have; it was written against the TensorRT 10 Python API
documentation and runs only in the GPU-gated tests (tests/test_trt_gpu.py).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.contract import DRAFT_BLOCK, DRAFT_CONTEXT, TARGET, Manifest, load_manifest, write_manifest
from ..runtime.errors import DFlashError
from ..runtime.trt import (
    ENGINE_DIR, ENGINE_FILES, PRECISIONS, Limits, check_precision, gpu_info, import_tensorrt, profile_record,
    resolve_limits,
)

GRAPHS = (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK)


@dataclass
class GraphPlan:
    graph: str
    onnx: str  # relative to OUT
    engine: str  # relative to OUT
    profiles: list[dict]  # [{name, ranges, shapes: {input: [min, opt, max]}}], index = TensorRT profile index


@dataclass
class BuildPlan:
    precision: str
    strongly_typed: bool  # network flag STRONGLY_TYPED: the ONNX types decide every layer's precision
    builder_flags: list[str]  # BuilderFlag names to set (weakly typed fp32 export built in fp16/bf16)
    workspace_bytes: int
    limits: Limits
    graphs: list[GraphPlan] = field(default_factory=list)


def default_timing_cache() -> Path:
    """Timing cache shared by every build on this machine (TensorRT keys entries by device and version)."""
    base = os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-export"
    return Path(base) / "trt-timing.cache"


def build_plan(manifest: Manifest, precision: str | None = None, max_context: int | None = None,
               max_prompt: int | None = None, workspace_gb: float = 4.0) -> BuildPlan:
    """The whole build decided from the manifest; raises DFlashError on impossible requests."""
    precision = precision or manifest.dtype
    if precision not in PRECISIONS:
        raise DFlashError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    strongly = check_precision(manifest.dtype, precision)
    if not workspace_gb > 0:
        raise DFlashError(f"--workspace {workspace_gb}: give the builder's workspace in GB, > 0")
    limits = resolve_limits(manifest, max_context, max_prompt)
    record = profile_record(manifest, limits)
    flags = [] if strongly else [precision.upper()]
    return BuildPlan(
        precision=precision,
        strongly_typed=strongly,
        builder_flags=flags,
        workspace_bytes=int(workspace_gb * (1 << 30)),
        limits=limits,
        graphs=[GraphPlan(g, manifest.graphs[g].file, ENGINE_FILES[g], record[g]) for g in GRAPHS],
    )


def describe(plan: BuildPlan) -> str:
    """Human-readable plan (printed by `build --dry-run` and before a build)."""
    lim = plan.limits
    lines = [
        f"precision {plan.precision} ({'strongly typed' if plan.strongly_typed else 'builder flags ' + ','.join(plan.builder_flags)}), "
        f"block {lim.block_size}, max context {lim.max_context}, max prompt {lim.max_prompt}, "
        f"workspace {plan.workspace_bytes / (1 << 30):g} GB"
    ]
    for g in plan.graphs:
        for i, p in enumerate(g.profiles):
            rng = ", ".join(f"{r} {a}..{c} (opt {b})" for r, (a, b, c) in p["ranges"].items() if r != "batch")
            lines.append(f"  {g.engine}  profile {i} {p['name']}: {rng}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# The build (needs TensorRT + GPU; not executed in development)
# ---------------------------------------------------------------------------------------


def _progress_monitor(trt, console):
    """A trt.IProgressMonitor that shows the builder's phases as rich progress bars."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def _build_one(trt, logger, out: Path, g: GraphPlan, plan: BuildPlan, cache_bytes: bytes, monitor) -> tuple[bytes, bytes]:
    """Parse one ONNX graph, build its engine; returns (engine bytes, updated timing cache)."""
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if plan.strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(out / g.onnx)):  # resolves external weights next to the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise DFlashError(f"TensorRT's ONNX parser rejected {g.onnx}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.workspace_bytes)
    for flag in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for p in g.profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p["shapes"].items():
            prof.set_shape(name, tuple(lo), tuple(opt), tuple(hi))
        config.add_optimization_profile(prof)
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    if monitor is not None:
        config.progress_monitor = monitor
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise DFlashError(f"TensorRT could not build an engine for {g.onnx} (see the TensorRT log above)")
    return bytes(blob), bytes(config.get_timing_cache().serialize())


def build_engines(out_dir: str | Path, precision: str | None = None, max_context: int | None = None,
                  max_prompt: int | None = None, timing_cache: str | Path | None = None,
                  workspace_gb: float = 4.0, progress: bool = True, echo=print) -> Manifest:
    """Build OUT/engines/*.engine and record them in OUT's manifest; all or nothing."""
    from .trt_lint import check as lint_check

    trt, cudart = import_tensorrt()  # first: without TensorRT nothing else happens
    out = Path(out_dir)
    manifest = load_manifest(out)
    plan = build_plan(manifest, precision, max_context, max_prompt, workspace_gb)
    try:
        cc, gpu = gpu_info(cudart)
    except DFlashError as e:
        raise DFlashError(f"no usable NVIDIA GPU for the TensorRT build ({e})") from None
    if plan.precision == "bf16" and tuple(int(x) for x in cc.split(".")) < (8, 0):
        raise DFlashError(f"bf16 engines need compute capability >= 8.0; this GPU ({gpu}) is {cc}: use --precision fp16")
    for w in lint_check(out, manifest, trt.__version__, plan.limits):
        echo(f"warning: {w}")
    echo(describe(plan))

    cache_path = Path(timing_cache) if timing_cache else default_timing_cache()
    cache_bytes = cache_path.read_bytes() if cache_path.is_file() else b""
    logger = trt.Logger(trt.Logger.WARNING)
    console = None
    if progress:
        from rich.console import Console
        console = Console(stderr=True)
    staging = out.parent / f".{out.name}.engines.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for i, g in enumerate(plan.graphs, 1):
            t0 = time.perf_counter()
            monitor = _progress_monitor(trt, console) if progress else None
            if monitor is not None:
                monitor.bars.start()
            try:
                blob, cache_bytes = _build_one(trt, logger, out, g, plan, cache_bytes, monitor)
            finally:
                if monitor is not None:
                    monitor.bars.stop()
            (staging / Path(g.engine).name).write_bytes(blob)
            echo(f"[{i}/{len(plan.graphs)}] {g.engine}: {len(blob) / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_bytes(cache_bytes)
        os.replace(tmp, cache_path)
        # all engines built: swap them in, then re-hash so the manifest covers them
        final = out / ENGINE_DIR
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest.engines = {
        "tensorrt": trt.__version__,
        "compute_capability": cc,
        "gpu": gpu,
        "precision": plan.precision,
        "strongly_typed": plan.strongly_typed,
        "block_size": plan.limits.block_size,
        "max_context": plan.limits.max_context,
        "max_prompt": plan.limits.max_prompt,
        "workspace_bytes": plan.workspace_bytes,
        "files": {g.graph: g.engine for g in plan.graphs},
        "profiles": {g.graph: g.profiles for g in plan.graphs},
    }
    write_manifest(out, manifest)
    echo(f"engines written to {out / ENGINE_DIR}; timing cache {cache_path}")
    return manifest
