"""TensorRT's optimization profiles without TensorRT: precision, limits, profiles.

Pure Python over the manifest, unit-tested without TensorRT (tests/test_trt_plan.py), shared
by both ways this project runs TensorRT: `export/trt_build.py` builds engines with these
profiles and `runtime/trt/backend.py` checks every call against them, and
`runtime/ort/trt_provider.py` hands the same shapes to ONNX Runtime's TensorRT execution
provider.

Precision is the export's: TensorRT 11 removed weak typing (the FP16/BF16 builder flags and
the precision-constraint flags), so every network is strongly typed and runs in the types
its ONNX graph declares. An fp16 engine comes from `dflash-export export --dtype fp16`.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import contract as C
from .contract import BATCH, CTX, DRAFT_BLOCK, DRAFT_CONTEXT, PAST, PAST_CTX, PICKS, SCORED, SEQ, TARGET
from .errors import DFlashError, InternalError
from .manifest import Manifest

PRECISIONS = ("fp32", "fp16", "bf16")


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
