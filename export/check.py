"""`dflash-export check`: every exported graph against its PyTorch source, then end to end.

Per graph and regime (target prefill at past 0, a 1-token step and a K-token verify on a
real past; the drafter's context graph; the block graph with and without context), fresh
random inputs go through both ONNX Runtime and the torch module the graph was traced
from; each output gets max / mean / p99 absolute error against its tolerance. Then N
random prompts are decoded greedily by what users run, the runtime's loop (runtime/loop.py)
over the ONNX Runtime backend, and by `models.speculative_generate`: tokens and acceptance
lengths must be identical.

fp32 passes at TOLERANCE on every float output (logits, taps, K/V) and exact ids (ties
within the tolerance excepted). fp16/bf16 report the same statistics and top-1 agreement;
they fail only on non-finite outputs.

A quantized artifact (export --quantize) is compared twice. Against the PyTorch source
with its weights replaced by the ones the graphs really multiply by (MatMulNBits weights
dequantized by export/quantize.py's independent reading of the format): this is parity of
the graphs themselves, at TOLERANCE and token for token end to end when the export is
fp32 and MatMulNBits computes in fp32 (accuracy level 0/1; other levels quantize
activations and are reported only). Against the float source, without tolerances: the
quantization error (statistics, top-1 agreement, and how many greedy tokens agree before
the first difference). Enforced in every case: speculative greedy decoding through the
quantized graphs == plain greedy decoding through the same graphs, token for token.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..runtime import contract as C, manifest as M
from ..runtime.hybrid import commit_state
from ..runtime.lazy import lazy_import
from ..runtime.load import open_backend
from ..runtime.loop import generate
from ..runtime.memory import available_memory
from ..runtime.names import names_of
from ..runtime.errors import DFlashError
from ..runtime.settings import WIDE
from . import sources as S
from .artifact import torch_dtype
from . import check_invariance
from .check_rows import block_inputs, ragged_rows, stored_rows, target_inputs
from .polygraphy_json import write_polygraphy
from .progress import Phases
from .quantize import dequantized_sources, dequantizers
from .save import read_initializers

torch = lazy_import("torch")  # torch, onnx, the reference models: on first use (runtime/lazy.py)
ml_dtypes = lazy_import("ml_dtypes")
onnx = lazy_import("onnx")
reference = lazy_import("dflash_export.models")
dflash2 = lazy_import("dflash_export.models.dflash2")
generate2 = lazy_import("dflash_export.models.generate_dflash2")
G = lazy_import("dflash_export.export.graphs")
kv_calibrate = lazy_import("dflash_export.export.kv_calibrate")
gqa = lazy_import("dflash_export.export.gqa")
layerwise = lazy_import("dflash_export.export.layerwise")

TOLERANCE = 1e-4  # fp32 absolute, on logits, taps and K/V alike


@dataclass
class Row:
    graph: str
    case: str
    output: str
    max: float | None  # None for id outputs (compared exactly)
    mean: float | None
    p99: float | None
    tol: float | None  # None: reported, not enforced (fp16/bf16)
    top1: float | None  # argmax agreement (logits) or id agreement (ids)
    passed: bool
    ref: str = "pytorch"  # quantized artifacts: "dequantized" (the graphs' own weights) or "float" (the source)


@dataclass
class Report:
    dtype: str
    rows: list[Row] = field(default_factory=list)
    end_to_end: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    quantization: dict | None = None  # the manifest's record for a quantized artifact
    strict: bool = False  # fp32 tolerances and token identity apply (fp32; quantized: vs the dequantized weights)
    draft_vocab: int | None = None  # N of a reduced draft vocabulary (None: the whole vocabulary)
    accuracy: dict | None = None  # quantized: the target logits' error by cause (accuracy_effect)
    warnings: list[str] = field(default_factory=list)  # sources that no longer match the manifest's record
    kv_cache: dict | None = None  # the ort flavour's int8 cache (Manifest.kv_cache): the PyTorch source keeps a float one
    rows_alike: dict | None = None  # quantized, MoE op, hybrid: a row's logits alone vs in a verify block / a batch (check_invariance)

    @property
    def passed(self) -> bool:
        e2e = self.end_to_end
        if not e2e:
            ok_e2e = True
        else:
            # an int8 cache: the source's own greedy (float cache) is reported; speculative == plain holds
            ok_e2e = not self.strict or self.kv_cache is not None or e2e["identical"] == e2e["cases"]
            if self.quantization is not None or self.kv_cache is not None:
                ok_e2e = ok_e2e and e2e["speculative_equals_plain"] == e2e["cases"]
        alike = self.rows_alike is None or self.rows_alike["invariant"] or not self.rows_alike["enforced"]
        return bool(self.rows) and all(r.passed for r in self.rows) and ok_e2e and alike

    def summary(self) -> str:
        """One line: outputs checked, the worst error against its tolerance, prompts identical."""
        floats = [r for r in self.rows if r.max is not None and r.ref != "float"]  # the quantization error is not parity
        worst = max(floats, key=lambda r: r.max / r.tol if r.tol else r.max, default=None)
        line = f"parity ({self.dtype}): {len(self.rows)} outputs checked"
        if worst is not None:
            tol = f"tolerance {worst.tol:g}" if worst.tol else "reported, not enforced"
            line += f", worst error {worst.max:.1e} ({worst.graph} {worst.output}; {tol})"
        ids = [r for r in self.rows if r.max is None]
        if ids:
            line += f", {sum(r.passed for r in ids)}/{len(ids)} id outputs equal"
        e = self.end_to_end
        if e:
            line += f", {e['identical']}/{e['cases']} prompts token-identical to PyTorch"
            if self.quantization is not None or self.kv_cache is not None:
                what = "float cache" if self.quantization is None else "dequantized weights"
                line += f" ({what}), speculative == plain on {e['speculative_equals_plain']}/{e['cases']}"
        if self.rows_alike is not None:
            b = self.rows_alike["block"]
            line += f", a row alone == in a verify block on {b['rows'] - b['rows_differing']}/{b['rows']}"
        if self.draft_vocab:
            line += f", draft vocabulary {self.draft_vocab}"
        return line + (": PASSED" if self.passed else ": FAILED")

    def to_json(self) -> dict:
        graphs: dict = {}
        for r in self.rows:
            graphs.setdefault(r.graph, []).append({k: v for k, v in asdict(r).items() if k != "graph"})
        return {"passed": self.passed, "dtype": self.dtype, "tolerance": TOLERANCE if self.strict else None,
                "quantization": self.quantization, "graphs": graphs, "end_to_end": self.end_to_end, "notes": self.notes,
                "draft_vocab": self.draft_vocab, "accuracy": self.accuracy, "warnings": self.warnings, "kv_cache": self.kv_cache,
                "rows_alike": self.rows_alike}


def accuracy_effect(rows: list[Row], q: dict) -> dict:
    """The target logits' error of a quantized artifact by cause, over check's target cases:
    vs the float source (weights and, above level 1, activations rounded) and vs the graphs'
    own dequantized weights (what the accuracy level's activation rounding adds alone)."""
    out = {"accuracy_level": q.get("accuracy_level"), "from": q.get("accuracy_level_from", "flag")}
    for ref in ("float", "dequantized"):
        logits = [r for r in rows if r.graph == C.TARGET and r.output == "logits" and r.ref == ref and r.max is not None]
        if logits:
            out[ref] = {"mean_abs": float(np.mean([r.mean for r in logits])), "max_abs": max(r.max for r in logits),
                        "top1": min(r.top1 for r in logits)}
    drafts = [r for r in rows if r.graph == C.DRAFT_BLOCK and r.output == C.DRAFT_LOGITS and r.ref == "float"
              and r.max is not None]
    if q.get("draft") and drafts:  # a quantized drafter: what rounding did to its logits (acceptance, not output)
        out["draft_float"] = {"mean_abs": float(np.mean([r.mean for r in drafts])), "max_abs": max(r.max for r in drafts),
                              "top1": min(r.top1 for r in drafts)}
    return out


def find_sources(manifest: M.Manifest, target, draft, warnings: list[str] | None = None):
    """The (target, drafter) Sources to compare with: those given (directories, ids or Sources),
    else the ones the manifest records; `warnings` gets a line for each that no longer matches its record."""
    recorded = manifest.sources or {}
    found = []
    for given, key, what in ((target, "target", "target"), (draft, "draft", "drafter")):
        spec = given if given is not None else S.spec_of(recorded.get(key))
        if spec is None:
            raise DFlashError(f"check compares against the PyTorch source: pass --target and --draft (the {what} given "
                              "to export; this manifest does not record it)")
        try:
            src = S.resolve(spec, what=what)
        except DFlashError as e:
            if given is not None:
                raise
            raise DFlashError(f"check compares against the PyTorch source, and the {what} the manifest records is not "
                              f"here ({e}); pass --target and --draft") from None
        if warnings is not None:
            warnings += S.differences(recorded.get(key), src, what)
        found.append(src)
    return found


def load_sources(root: Path, manifest: M.Manifest, target_dir, draft_dir, warnings: list[str] | None = None,
                 by_layer: bool = False, dequantized: dict | None = None):
    """The PyTorch modules an artifact came from; refuse sources that do not match it.
    `by_layer`: their large weights read per call (export/layerwise.py), replaced by
    `dequantized`'s (quantize.dequantizers) where given."""
    tsrc, dsrc = find_sources(manifest, target_dir, draft_dir, warnings)
    tc, dc = reference.TargetConfig.load(tsrc.path), dflash2.load_draft_config(dsrc.path)
    mine = (tc.architecture, tc.vocab_size, tc.hidden_size, tc.num_layers, dc.num_layers, list(dc.target_layer_ids))
    theirs = (manifest.architecture, manifest.vocab_size, manifest.hidden_size, manifest.target_layers,
              manifest.draft_layers, manifest.target_layer_ids)
    if mine != theirs:
        raise DFlashError(f"--target {tsrc.label} / --draft {dsrc.label} do not match {root} (architecture, vocab, hidden, "
                          f"layers, taps: {mine} vs {theirs}); pass the ones it was exported from")
    dtype = torch_dtype(manifest.dtype)
    ids = torch.tensor(draft_vocab_ids(root, manifest)) if manifest.draft_vocab else None
    if by_layer:
        pair = layerwise.load_pair(tsrc.path, dsrc.path, dtype, dc, ids, dequantized, f"drafter {dsrc.label}")
        target, drafter = pair.target, pair.drafter
    else:
        drafter = dflash2.load_drafter(dsrc.path, dtype, config=dc)
        target = reference.Target.from_pretrained(tsrc.path, drafter.config.target_layer_ids, dtype)
        drafter.attach(target, f"drafter {dsrc.label}")
        if ids is not None and drafter.vocab_ids is None:  # the reference scores the same N tokens, read back from the graph
            drafter.set_draft_vocab(ids, target.lm_head.weight)
    if ids is not None and drafter.vocab_ids is not None and drafter.vocab_ids.tolist() != ids.tolist():
        raise DFlashError(f"drafter {dsrc.label}: its own draft vocabulary (d2t) is not the one {root} holds")
    if ids is None and drafter.vocab_ids is not None:
        raise DFlashError(f"drafter {dsrc.label} scores its own draft vocabulary, but {root} scores every token")
    torch.manual_seed(0)
    return target, drafter


def needs_by_layer(root: Path, m: M.Manifest, target_dir, draft_dir) -> bool:
    """Whether the whole PyTorch source (twice for a quantized artifact: the float one and the
    dequantized one) and the graphs would not fit in the memory available now."""
    avail = available_memory()
    try:
        tsrc, dsrc = find_sources(m, target_dir, draft_dir)
        if avail is None or layerwise.supported(tsrc.path):
            return False
        weights = sum(layerwise.weight_bytes(src.path, torch_dtype(m.dtype)) for src in (tsrc, dsrc))
    except DFlashError:
        return False  # load_sources says what is wrong
    graphs = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
    return weights * (2 if m.quantization else 1) + graphs > 0.8 * avail


def _weights(models) -> list:
    """The Layerwise records of modules read layer at a time (export/layerwise.py)."""
    return list({id(w): w for w in (getattr(x, "layerwise", None) for x in models) if w is not None}.values())


def draft_vocab_ids(root: Path, m: M.Manifest) -> np.ndarray:
    """The N target ids of a reduced draft vocabulary, as draft_block.onnx holds them."""
    path = root / m.graphs[C.DRAFT_BLOCK].file
    ids = read_initializers(root, onnx.load(str(path), load_external_data=False), {"vocab_ids"}).get("vocab_ids")
    if ids is not None and ids.shape == (m.draft_vocab["size"],):
        return ids
    raise DFlashError(f"{path}: no vocab_ids of {m.draft_vocab['size']} tokens, which the manifest's draft_vocab says it has; re-export")


def cases(target, drafter, m: M.Manifest, seed: int, kv_scales=None):
    """(graph, case, torch module, inputs in graph order) for every regime that matters
    (`kv_scales`: the ort flavour's int8 cache, kv_calibrate.read_scales)."""
    g = torch.Generator().manual_seed(seed)
    K, P, S = m.block_size, 9, 7
    ids = lambda n: torch.randint(0, m.vocab_size, (1, n), generator=g)  # noqa: E731
    pos = lambda a, n: torch.arange(a, a + n)[None]  # noqa: E731
    ragged = C.ragged(m)
    tg, cg, bg = (G.wrapper(g, target, drafter, C.flavour(m), m.max_context, ragged, C.ring(m), C.draft_index(m), kv_scales)
                  for g in (C.TARGET, C.DRAFT_CONTEXT, C.DRAFT_BLOCK))
    with torch.inference_mode():
        _, taps, past = target(ids(P), pos(0, P), target.empty_kv())
        ctx = drafter.context_kv(taps, pos(0, P))
        if hasattr(target, "new_cache"):  # hybrid: the committed K/V and DeltaNet states
            cache = target.new_cache(P)
            cache.append(past)
            past = cache.view()
    block = lambda: torch.cat([ids(1), torch.full((1, K - 1), m.mask_token_id)], 1)  # noqa: E731
    cached = lambda kv, p, s: target_inputs(m, kv, p, s, scales=kv_scales)  # noqa: E731
    yield C.TARGET, f"prefill P=0 S={S}", tg, [ids(S), pos(0, S), *cached(target.empty_kv(), 0, S)]
    yield C.TARGET, f"step P={P} S=1", tg, [ids(1), pos(P, 1), *cached(past, P, 1)]
    yield C.TARGET, f"verify P={P} S={K}", tg, [ids(K), pos(P, K), *cached(past, P, K)]
    ring = (C.window(m) or {}).get("ring")
    if ring and ring + 3 + K <= m.max_context:  # a past past the window: the sliding layers' rings have wrapped
        P2 = ring + 3
        with torch.inference_mode():
            cache = target.new_cache(P2)
            cache.append(target(ids(P2), pos(0, P2), target.empty_kv())[2])
        yield C.TARGET, f"verify P={P2} S={K} (rings wrapped)", tg, [ids(K), pos(P2, K), *cached(cache.view(), P2, K)]
    yield C.DRAFT_CONTEXT, f"C={P}", cg, [taps, pos(0, P)]
    yield C.DRAFT_CONTEXT, "C=1", cg, [taps[:, -1:], pos(P - 1, 1)]
    yield C.DRAFT_BLOCK, f"past_ctx=0 K={K}", bg, [block(), pos(0, K), *block_inputs(m, drafter.empty_kv(), 0)]
    yield C.DRAFT_BLOCK, f"past_ctx={P} K={K}", bg, [block(), pos(P, K), *block_inputs(m, ctx, P)]
    if C.draft_index(m) and K > 2:  # the head over the first drafts only (a short verify's)
        n = (K - 1) // 2
        yield C.DRAFT_BLOCK, f"past_ctx={P} K={K} head over {n}", bg, [block(), pos(P, K), *block_inputs(m, ctx, P, n)]


def committed_state_rows(target, m: M.Manifest, session, seed: int, strict: bool) -> list[Row]:
    """Hybrid targets: the states the runtime commits from a verify's outputs (a prefix of
    it: a rollback; runtime/hybrid.py) against the PyTorch cache's own commit (held to the
    fp32 tolerance only where the graphs' own outputs are: `strict`)."""
    g = torch.Generator().manual_seed(seed + 7)
    P, K = 9, m.block_size
    n = max(1, K // 2)
    ids = torch.randint(0, m.vocab_size, (1, P + K), generator=g)
    cache = target.new_cache(P + K)
    names_in, names_out = C.names(C.TARGET, m)
    with torch.inference_mode():
        cache.append(target(ids[:, :P], torch.arange(P)[None], cache.view())[2])
        feeds = dict(zip(names_in, [_np(ids[:, P:]), np.arange(P, P + K)[None],
                                    *map(_np, target_inputs(m, cache.view(), P, K))]))
        got = dict(zip(names_out, session.run(names_out, feeds)))
        cache.append(target(ids[:, P:], torch.arange(P, P + K)[None], cache.view())[2], n)
    names, mine, ref, N = [], [], [], names_of(m)
    for i, (conv_ref, state_ref) in enumerate(cache.view()):
        if not m.is_linear(i):
            continue
        conv = np.concatenate([feeds[N.conv_state[i]][0], got[N.new_conv[i]][0, :n]], 0)[-conv_ref.shape[1]:]
        state = feeds[N.rec_state[i]][0].copy()
        commit_state(state, *(got[name][0, :n] for name in N.delta[i]))
        names += [f"{N.conv_state[i]} committed", f"{N.rec_state[i]} committed"]
        mine += [conv[None], state[None]]
        ref += [_np(conv_ref), _np(state_ref)]
    return compare(C.TARGET, f"commit {n} of verify P={P} S={K}", names, mine, ref, strict)


def _np(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def compare(graph: str, case: str, names: list[str], got: list[np.ndarray], ref: list[np.ndarray], strict: bool,
            against: str = "pytorch") -> list[Row]:
    by_name = dict(zip(names, ref))
    rows = []
    for name, o, r in zip(names, got, ref):
        if o.shape != r.shape:
            rows.append(Row(graph, case, name, float("inf"), float("inf"), float("inf"), TOLERANCE if strict else None, None, False))
            continue
        if r.dtype == np.int8:  # an int8 cache: a value at a rounding boundary may land one step either side
            err = np.abs(o.astype(np.int32) - r.astype(np.int32)).ravel()
            mx = float(err.max()) if err.size else 0.0
            mean, p99 = (float(err.mean()), float(np.percentile(err, 99))) if err.size else (0.0, 0.0)
            rows.append(Row(graph, case, name, mx, mean, p99, 1.0 if strict else None, None, mx <= 1 or not strict))
            continue
        if np.issubdtype(r.dtype, np.integer):
            agree = o == r
            logits = by_name.get(C.ID_LOGITS.get(name))
            if logits is not None:  # a flip between two logits closer than the tolerance is not an error
                top2 = np.sort(logits.astype(np.float64), -1)[..., -2:]
                agree |= (top2[..., 1] - top2[..., 0]) <= TOLERANCE
            top1 = float(np.mean(o == r)) if o.size else 1.0
            rows.append(Row(graph, case, name, None, None, None, 0.0 if strict else None, top1, bool(agree.all()) or not strict))
            continue
        err = np.abs(o.astype(np.float64) - r.astype(np.float64)).ravel()
        finite = bool(np.isfinite(o.astype(np.float64)).all())
        mx, mean, p99 = (float(err.max()), float(err.mean()), float(np.percentile(err, 99))) if err.size else (0.0,) * 3
        top1 = None
        if name in C.ID_LOGITS.values() and o.size:
            top1 = float(np.mean(o.argmax(-1) == r.argmax(-1)))
        passed = finite and (mx <= TOLERANCE if strict else True)
        rows.append(Row(graph, case, name, mx, mean, p99, TOLERANCE if strict else None, top1, passed))
    for r in rows:
        r.ref = against
    return rows


def small_ops_one_thread(run):
    """Run `run(root, ...)` with torch on one intra-op thread when root's model is narrow (hidden <
    runtime.settings.WIDE, the runtime's own rule for ONNX Runtime): the PyTorch reference of a
    small model is thousands of tiny ops (a mixture of experts: several per expert and layer),
    and a second thread only adds a handoff to each. A 4-layer, 64-wide MoE target decoded a
    24-token prompt in 0.4 s on one thread and 20 s on two, on a shared 2-vCPU machine at load 19."""

    @functools.wraps(run)
    def wrapper(root, *args, **kwargs):
        before = torch.get_num_threads()
        if M.load_manifest(root, verify=False).hidden_size < WIDE:
            torch.set_num_threads(1)
        try:
            return run(root, *args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


@small_ops_one_thread
def run_check(
    root: str | Path,
    target_dir,
    draft_dir,
    *,
    prompts: int | list[list[int]] = 20,
    max_new_tokens: int = 24,
    seed: int = 0,
    save_polygraphy: str | Path | None = None,
    provider: str = "cpu",
    progress: bool = True,
    by_layer: bool | None = None,
) -> Report:
    """`by_layer`: the PyTorch source's matrices are read per call (export/layerwise.py: about
    one at a time) instead of held; None: when the whole source would not fit beside the graphs."""
    root = Path(root)
    m = M.load_manifest(root, verify=True)
    if not isinstance(prompts, int):  # given prompts (check --prompts FILE): refused before anything loads
        for i, p in enumerate(prompts, 1):
            if not p or len(p) + max_new_tokens > m.max_context:
                raise DFlashError(f"prompt {i} has {len(p)} tokens: with --max-new-tokens {max_new_tokens} it needs 1 to "
                                  f"{m.max_context - max_new_tokens} for the max context {m.max_context}")
            if not all(0 <= t < m.vocab_size for t in p):
                raise DFlashError(f"prompt {i} holds token ids outside the vocabulary [0, {m.vocab_size})")
    ui = Phases(progress)
    q = m.quantization
    report = Report(m.dtype, quantization=q, strict=m.dtype == "fp32",
                    draft_vocab=C.draft_vocab_size(m) if m.draft_vocab else None, kv_cache=C.kv_cache(m))
    if by_layer is None:
        by_layer = needs_by_layer(root, m, target_dir, draft_dir)
    with ui.phase("load", f"PyTorch source{' (read layer at a time)' if by_layer else ''} + ONNX Runtime sessions "
                          f"({m.dtype})"):
        target, drafter = load_sources(root, m, target_dir, draft_dir, report.warnings, by_layer)
        ref_models = (target, drafter)
        if q is not None:  # the reference for parity: the source with the graphs' own (dequantized) weights
            if by_layer:  # read per call too
                try:
                    dequantized, why = load_sources(root, m, target_dir, draft_dir, None, True, dequantizers(root)), None
                except DFlashError as e:
                    dequantized, why = None, str(e)
            else:
                dequantized, why = dequantized_sources(root, target, drafter)
            if dequantized is None:
                report.notes.append(f"no dequantized reference ({why}); reported against the float source only")
                report.strict = False
            else:
                ref_models = dequantized
                if (q.get("accuracy_level") or 0) > 1:
                    report.notes.append(f"accuracy level {q['accuracy_level']} quantizes activations too: "
                                        "the dequantized reference is reported, not held to fp32 tolerances")
                    report.strict = False
                elif q.get("bits") == 8 and (m.moe or {}).get("path") == "op":
                    report.notes.append("int8 experts: ONNX Runtime's QMoE has no fp32 kernel for block-wise 8-bit "
                                        "experts on CPU and quantizes their activations to int8, so the graphs differ "
                                        "from the dequantized reference by that rounding too: reported, not held to "
                                        "fp32 tolerances")
                    report.strict = False
        try:
            backend = open_backend(root, "ort", provider, verify=False)  # hashes verified just above
        except DFlashError as e:
            if m.dtype == "bf16" and provider == "cpu":
                report.notes.append(f"not run: ONNX Runtime's CPU provider cannot run bf16 graphs (try --provider cuda) ({str(e)[:160]})")
                return report
            raise
    saved = []
    kv_scales = kv_calibrate.read_scales(root) if C.kv_cache(m) else None
    gqa.STORED_STATS.update(values=0, one_step_apart=0)
    with ui.phase("parity", "every graph in every regime vs PyTorch"):
        for graph, case, module, inputs in cases(*ref_models, m, seed, kv_scales):
            names_in, names_out = C.names(graph, m)
            feeds = dict(zip(names_in, (_np(t) for t in inputs)))
            got = backend.sessions[graph].run(names_out, feeds)
            stored = contextlib.nullcontext()
            if kv_scales is not None and graph == C.TARGET:  # the reference given ORT's int8 stores (gqa.stored_as)
                counts = feeds[C.SEQLENS_K] + 1 - feeds[C.POSITION_IDS][:, 0]
                stored = gqa.stored_as(stored_rows(names_out, got, [(r, int(feeds[C.SEQLENS_K][r]) + 1 - int(c), int(c))
                                                                    for r, c in enumerate(counts)]))
            with stored, torch.inference_mode():
                ref = [_np(t) for t in module(*inputs)]
            got, ref = written_rows(feeds, names_out, got), written_rows(feeds, names_out, ref)
            if q is None:
                report.rows += compare(graph, case, names_out, got, ref, report.strict)
            else:
                if ref_models[0] is not target:
                    report.rows += compare(graph, case, names_out, got, ref, report.strict, "dequantized")
                with torch.inference_mode():
                    ref_float = [_np(t) for t in G.wrapper(graph, target, drafter, C.flavour(m), m.max_context,
                                                         C.ragged(m), C.ring(m), C.draft_index(m), kv_scales)(*inputs)]
                report.rows += compare(graph, case, names_out, got, written_rows(feeds, names_out, ref_float), False,
                                       "float")
            saved.append((graph, case, feeds, dict(zip(names_out, ref)), dict(zip(names_out, got))))
        if m.linear_layers:
            report.rows += committed_state_rows(ref_models[0], m, backend.sessions[C.TARGET], seed, report.strict)
        against = "pytorch" if q is None else "dequantized" if ref_models[0] is not target else "float"
        report.rows += ragged_rows(*ref_models, m, backend.sessions, seed, report.strict, compare, _np, against, kv_scales)
    if kv_scales is not None:
        st = gqa.STORED_STATS
        report.notes.append(f"int8 K/V cache ({C.kv_cache(m)['scales']} scales): the PyTorch reference quantizes it as "
                            f"GroupQueryAttention does; {st['one_step_apart']} of {st['values']} values it stored were one "
                            "step from ONNX Runtime's (a float difference across a rounding boundary): the reference took "
                            "ONNX Runtime's there (export/gqa.py stored_as), more than one step fails present_*")
    if q is not None:
        report.accuracy = accuracy_effect(report.rows, q)
    # the quantized target's kernels (and the MoE op / linear attention at any dtype): does a row's output depend on
    # how many rows share the call? (export/even_rows.py)
    if (q is not None and q.get("target", True)) or m.rows_vary:
        with ui.phase("rows", "a row's logits alone vs in a verify block and a batch"):
            report.rows_alike = ra = check_invariance.row_invariance(root, m, seed)
        # linear-attention layers and the MoE op's experts differ alone vs in a block at fp32 too (Manifest.rows_vary):
        # reported, not failed, where the graph has them
        other = m.rows_vary
        ra["enforced"] = not other
        if other and not ra["invariant"]:
            report.notes.append(f"a row's logits alone differ from the same row's in a verify block (max "
                                f"{ra['block']['max_abs']:.1e}) through this target's {' and '.join(other)}, at any "
                                "dtype: speculative == plain except where the top two logits are that close (docs/quantization.md)")
    if by_layer:
        loads = sum(len(w.lazy) for w in _weights(ref_models))
        held = max((w.stats.peak for w in _weights((target, drafter, *ref_models))), default=0)
        report.notes.append(f"PyTorch reference read layer at a time: {loads} modules' weights read per forward, "
                            f"at most {held / 2**20:.0f} MiB of them held at once")
    if save_polygraphy is not None:
        with ui.phase("save", f"Polygraphy inputs/outputs to {save_polygraphy}"):
            write_polygraphy(Path(save_polygraphy), saved)
    n = prompts if isinstance(prompts, int) else len(prompts)
    if n > 0:
        what = f"{n} prompts x {max_new_tokens} tokens, runtime loop on ORT vs speculative_generate"
        with ui.phase("generate", what) as status:
            oracle = generate2.dflash2_generate if C.selector(m) else reference.speculative_generate  # DFlash 2: the walk
            t0 = time.perf_counter()
            tick = lambda i: status.update(f"[bold]generate[/] {what}: prompt {i + 1}/{n}, "  # noqa: E731
                                           f"{time.perf_counter() - t0:.0f} s")
            report.end_to_end = end_to_end(backend, *ref_models, m, prompts, max_new_tokens, seed, oracle,
                                           float_models=None if q is None and kv_scales is None else (target, drafter),
                                           tick=tick)
    return report


def written_rows(feeds: dict, names: list[str], outs: list) -> list:
    """The ort flavour's present buffers cut to the rows written so far (the rest is free
    space whose contents no call reads); other outputs as they are."""
    if C.TOTAL_LEN not in feeds:
        return outs
    n = int(feeds[C.TOTAL_LEN])
    return [x[:, :, :n] if name.startswith("present_") else x for name, x in zip(names, outs)]


def end_to_end(backend, target, drafter, m: M.Manifest, prompts: int | list[list[int]], max_new_tokens: int, seed: int,
               oracle, float_models=None, tick=lambda i: None) -> dict:
    """Greedy speculative decoding (no stop tokens) by the deployed loop (runtime/loop.py over
    the ORT backend) vs the oracle on (target, drafter). Quantized (float_models: the float
    source): also decode each prompt plainly through target.onnx with the same loop
    (speculative == plain) and measure the greedy agreement length with the float source.
    `prompts`: how many random ones (seeded), or the prompts themselves; tick(i) before prompt i."""
    rng = np.random.default_rng(seed + 1)
    identical, same_lengths, lengths, failures = 0, 0, [], []
    self_same, agree, self_failures = 0, [], []
    given = None if isinstance(prompts, int) else prompts
    for i in range(prompts if given is None else len(given)):
        tick(i)
        if given is None:
            n = min(int(rng.integers(2, 12)), m.max_context - max_new_tokens)
            prompt = rng.integers(0, m.vocab_size, n).tolist()
        else:
            prompt = list(given[i])
        g = generate(backend, prompt, max_new_tokens, stop_token_ids=())
        tokens, acc = g.tokens, g.acceptance_lengths
        ref = oracle(target, drafter, prompt, max_new_tokens, mask_token_id=m.mask_token_id, block_size=m.block_size)
        identical += tokens == ref.tokens
        same_lengths += acc == ref.acceptance_lengths
        lengths += acc
        if float_models is not None:
            own = generate(backend, prompt, max_new_tokens, stop_token_ids=(), draft=False).tokens
            self_same += own == tokens
            fl = oracle(*float_models, prompt, max_new_tokens, mask_token_id=m.mask_token_id, block_size=m.block_size)
            agree.append(_first_difference(tokens, fl.tokens))
            if own != tokens and len(self_failures) < 3:
                self_failures.append({"prompt": prompt, "first_difference": _first_difference(tokens, own),
                                      "speculative": tokens, "plain": own})
        if tokens != ref.tokens and len(failures) < 3:
            failures.append({"prompt": prompt, "first_difference": _first_difference(tokens, ref.tokens),
                             "onnx": tokens, "pytorch": ref.tokens})
    hist = np.bincount(lengths, minlength=m.block_size + 1)[1:].tolist() if lengths else []
    out = {"cases": prompts if given is None else len(given), "identical": identical, "acceptance_identical": same_lengths,
           "max_new_tokens": max_new_tokens, "tau": float(np.mean(lengths)) if lengths else 0.0,
           "acceptance_histogram": hist, "failures": failures}
    if float_models is not None:
        out.update(speculative_equals_plain=self_same, plain_failures=self_failures,
                   agreement_length_mean=float(np.mean(agree)) if agree else 0.0,
                   agreement_length_min=int(min(agree)) if agree else 0)
    return out


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
