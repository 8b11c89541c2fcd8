"""TensorRT arithmetic without TensorRT: versions, precision, limits, optimization profiles.

Everything here is pure Python over the manifest, unit-tested without TensorRT
(tests/test_trt_plan.py). `export/trt_build.py` builds engines with these profiles,
`runtime/trt/backend.py` checks every call against them, and `ort_trt_provider_options`
hands the same shapes to ONNX Runtime's TensorRT execution provider.

Precision is the export's: TensorRT 11 removed weak typing (the FP16/BF16 builder flags and
the precision-constraint flags), so every network is strongly typed and runs in the types
its ONNX graph declares. An fp16 engine comes from `dflash-export export --dtype fp16`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .. import contract as C
from ..contract import BATCH, CTX, DRAFT_BLOCK, DRAFT_CONTEXT, PAST, PAST_CTX, PICKS, SCORED, SEQ, TARGET
from ..manifest import Manifest
from ...errors import DFlashError, InternalError

# Supported TensorRT: >= 10.12 (the release that deprecated weak typing; from it on the same
# strongly typed build and runtime code serves 10.x and 11.x) and < 12. Same range as the
# `trt` extra in pyproject.toml.
TRT_MIN, TRT_BELOW = (10, 12), (12, 0)
ENGINE_DIR = "engines"
ENGINE_FILES = {g: f"{ENGINE_DIR}/{g}.engine" for g in (TARGET, DRAFT_CONTEXT, DRAFT_BLOCK)}
PRECISIONS = ("fp32", "fp16", "bf16")


def trt_version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT version string such as "11.5.0.12"."""
    parts = [p for p in str(version).split(".")[:2]]
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise DFlashError(f"cannot read the TensorRT version {version!r}") from None


def check_trt_version(version: str) -> None:
    """Refuse a TensorRT outside the supported range, naming the range."""
    v = trt_version_tuple(version)
    if not TRT_MIN <= v < TRT_BELOW:
        lo, hi = ".".join(map(str, TRT_MIN)), TRT_BELOW[0]
        raise DFlashError(f"TensorRT {version} is not supported: this version of dflash-export needs "
                          f'TensorRT >= {lo}, < {hi} (pip install "dflash-export[trt]")')


def check_precision(export_dtype: str, precision: str | None) -> str:
    """The engine precision: the export's dtype. Anything else is refused (strong typing only)."""
    if precision is None or precision == export_dtype:
        return export_dtype
    if precision not in PRECISIONS:
        raise DFlashError(f"--precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    raise DFlashError(
        f"--precision {precision} but the graphs were exported in {export_dtype}; TensorRT builds strongly typed "
        f"networks in the export's types: re-export with `dflash-export export --dtype {precision}`"
    )


def refuse_quantized(manifest: Manifest) -> None:
    """Weight-only quantized graphs hold ONNX Runtime's MatMulNBits, which TensorRT's parser does not take."""
    q = manifest.quantization
    if q is not None:
        raise DFlashError(f"this export is quantized ({q['scheme']} weights as ONNX Runtime MatMulNBits), which TensorRT "
                          "cannot parse (TensorRT quantizes through Q/DQ nodes, which dflash-export does not write); build from an export "
                          "without --quantize")


# ---------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------

def axis_role(graph: str, name: str, axis: int, manifest: Manifest | None = None) -> str | None:
    """The contract's role of one input axis (runtime/contract.py), None for a name or axis it lacks."""
    try:
        return C.role(graph, name, axis, manifest)
    except (DFlashError, IndexError):
        return None


@dataclass
class Profile:
    """One TensorRT optimization profile: (min, opt, max) for each profiled quantity."""

    name: str
    ranges: dict[str, tuple[int, int, int]]

    def shapes(self, manifest: Manifest, graph: str) -> dict[str, tuple[tuple, tuple, tuple]]:
        """(min, opt, max) shape of every input of `graph`, from the contract's dim roles."""
        out = {}
        for t in C.io(graph, manifest)[0]:
            missing = [r for r in t.dims if r in C.DYNAMIC and r not in self.ranges]
            if missing:
                raise InternalError(f"{graph} input {t.name} has the dynamic dim {missing[0]!r} "
                                  f"but TensorRT profile {self.name!r} gives it no range")
            out[t.name] = tuple(C.shape(t, manifest, **{r: v[i] for r, v in self.ranges.items()}) for i in range(3))
        return out


@dataclass
class Limits:
    """The sequence limits engines are built for (recorded in the manifest's `engines`)."""

    block_size: int
    max_context: int
    max_prompt: int
    max_batch: int = 1  # rows per call (ragged exports; the block stays static)


def resolve_limits(manifest: Manifest, max_context: int | None = None, max_prompt: int | None = None,
                   max_batch: int = 1) -> Limits:
    """Defaults and checks: max_context <= the export's, prompt + one block must fit, batches
    only for exports with ragged graphs."""
    if max_batch < 1:
        raise DFlashError(f"--max-batch must be at least 1 (got {max_batch})")
    if max_batch > 1 and not C.ragged(manifest):
        raise DFlashError("--max-batch > 1: this directory was exported before batched decoding (batch 1 only); "
                          "re-export it with this dflash-export")
    k = manifest.block_size
    mc = manifest.max_context if max_context is None else int(max_context)
    if mc > manifest.max_context:
        raise DFlashError(
            f"--max-context {mc} exceeds the export's max_context {manifest.max_context}; "
            "re-export with a larger --max-context or pass a smaller --max-context to build"
        )
    if mc < k + 1:
        raise DFlashError(f"--max-context {mc} is too small for block size {k}: it must be at least {k + 1}")
    mp = max(1, mc // 2) if max_prompt is None else int(max_prompt)
    cap = C.max_seq(manifest)
    if cap:  # hybrid target: one delta-rule chunk per call (runtime/contract.py); prefill is chunked
        if max_prompt is not None and mp > cap:
            raise DFlashError(f"--max-prompt {mp}: a hybrid target takes at most {cap} positions per call "
                              "(prefill is chunked); lower it")
        mp = min(mp, cap)
    if mp < 1 or mp + k > mc:
        raise DFlashError(
            f"--max-prompt {mp} must be between 1 and max_context - block_size = {mc - k} "
            "(a full prompt plus one block has to fit in the context)"
        )
    return Limits(block_size=k, max_context=mc, max_prompt=mp, max_batch=int(max_batch))


def profiles(limits: Limits) -> dict[str, list[Profile]]:
    """The engines' optimization profiles, per graph, in profile-index order.

    target        0 verify:  seq in [1, K] (adaptive verify checks a prefix), past in [0, max_context - 1]
                  1 prefill: seq in [1, max_prompt], past in [0, max_context - 1]
                    (covers chunked prefill and the 1-token steps of plain decoding)
    draft_context 0 context: ctx in [1, max(max_prompt, K)] (a prompt, or a round's a+1 <= K)
    draft_block   0 block:   past_ctx in [1, max_context - 1] (the anchor's position; K static;
                    near the end the loop still drafts a full block and discards the overhang),
                    and (exports with draft_index) the drafts its head scores in [1, K - 1], opt K - 1
    opt is the middle of each range, except verify's seq (K) and ctx (K: the per-round size).
    Every profile takes batch in [1, max_batch] (opt max_batch: a full batch is the hot path;
    a joining row's prefill runs alone) and, ragged exports, `picks` (logits_index) in
    [1, seq max]: a verify picks every position, a prefill its last.
    """
    k, mc, mp, mb = limits.block_size, limits.max_context, limits.max_prompt, limits.max_batch

    def rng(lo: int, hi: int, opt: int | None = None) -> tuple[int, int, int]:
        return (lo, (lo + hi) // 2 if opt is None else opt, hi)

    one = (1, mb, mb)
    cmax = max(mp, k)
    return {
        TARGET: [
            Profile("verify", {BATCH: one, SEQ: (1, k, k), PICKS: (1, k, k), PAST: rng(0, mc - 1)}),
            Profile("prefill", {BATCH: one, SEQ: rng(1, mp), PICKS: (1, 1, mp), PAST: rng(0, mc - 1)}),
        ],
        DRAFT_CONTEXT: [Profile("context", {BATCH: one, CTX: rng(1, cmax, min(k, cmax))})],
        DRAFT_BLOCK: [Profile("block", {BATCH: one, PAST_CTX: rng(1, mc - 1), SCORED: (1, max(1, k - 1), max(1, k - 1))})],
    }


def profile_record(manifest: Manifest, limits: Limits) -> dict[str, list[dict]]:
    """Profiles as JSON for the manifest: {graph: [{name, ranges, shapes{input: [min, opt, max]}}]}."""
    out = {}
    for graph, plist in profiles(limits).items():
        out[graph] = [
            {
                "name": p.name,
                "ranges": {r: list(v) for r, v in p.ranges.items()},
                "shapes": {n: [list(s) for s in mmo] for n, mmo in p.shapes(manifest, graph).items()},
            }
            for p in plist
        ]
    return out


def check_engine_record(record: dict | None, trt_version: str, compute_capability: str) -> None:
    """Refuse engines this process cannot run: missing, other TensorRT, other GPU arch.

    A serialized engine is only valid for the exact TensorRT version that built it and the
    GPU compute capability it was built on (TensorRT's portability rule; this project does
    not use version- or hardware-compatible engines).
    """
    if not record:
        raise DFlashError("this directory has no TensorRT engines; build them first with `dflash-export build OUT`")
    built = str(record.get("tensorrt", "?"))
    if built != trt_version:
        raise DFlashError(
            f"the engines were built with TensorRT {built} but this process has TensorRT {trt_version}; "
            f"rebuild them with this TensorRT: `dflash-export build OUT` (or install tensorrt=={built})"
        )
    cc = str(record.get("compute_capability", "?"))
    if cc != compute_capability:
        gpu = record.get("gpu", "another GPU")
        raise DFlashError(
            f"the engines were built for compute capability {cc} ({gpu}) but this GPU is {compute_capability}; "
            "engines do not move between GPU architectures: rebuild them on this GPU with `dflash-export build OUT`"
        )


# ---------------------------------------------------------------------------------------
# ONNX Runtime's TensorRT execution provider (same profiles, one per graph)
# ---------------------------------------------------------------------------------------


def default_cache_dir(manifest: Manifest) -> Path:
    """Engine/timing cache of ORT's TensorRT provider: outside the exported directory.

    The exported directory is hash-verified (load_manifest refuses unlisted files), so the
    provider's cache lives under ~/.cache (or $DFLASH_TRT_CACHE), one folder per artifact.
    """
    base = Path(os.environ.get("DFLASH_TRT_CACHE") or Path.home() / ".cache" / "dflash-export" / "ort-trt")
    key = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(manifest.files.items())).encode()).hexdigest()[:16]
    return base / key


def _shape_str(shape: tuple) -> str:
    return "x".join(str(int(d)) for d in shape)


def ort_trt_provider_options(
    manifest: Manifest,
    graph: str,
    *,
    precision: str | None = None,
    max_context: int | None = None,
    max_prompt: int | None = None,
    cache_dir: str | Path | None = None,
    workspace_gb: float = 4.0,
    device_id: int = 0,
) -> dict:
    """Provider options for `TensorrtExecutionProvider` on one graph, from the manifest.

    ORT gets one explicit profile per graph (its options take min/opt/max per input): for
    the target the union of verify and prefill, with opt at the verify shape (the hot path).
    No trt_fp16_enable/trt_bf16_enable: those are weak typing, gone in TensorRT 11; the
    graph's own types decide. Engine and timing caches live in `cache_dir` (not in OUT).
    """
    check_precision(manifest.dtype, precision)
    limits = resolve_limits(manifest, max_context, max_prompt)
    union = {}
    for p in profiles(limits)[graph]:
        for role, (a, b, c) in p.ranges.items():
            a0, b0, c0 = union.get(role, (a, b, c))
            union[role] = (min(a, a0), b0, max(c, c0))  # opt of the first (verify) profile
    shapes = Profile("ort", union).shapes(manifest, graph)
    dynamic = [t.name for t in C.io(graph, manifest)[0] if any(r in C.DYNAMIC for r in t.dims)]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(manifest)
    opts = {
        "device_id": device_id,
        "trt_max_workspace_size": int(workspace_gb * (1 << 30)),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(cache),
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": str(cache),
    }
    if dynamic:
        for key, i in (("trt_profile_min_shapes", 0), ("trt_profile_opt_shapes", 1), ("trt_profile_max_shapes", 2)):
            opts[key] = ",".join(f"{n}:{_shape_str(shapes[n][i])}" for n in dynamic)
    return opts
