"""Export a target + drafter pair to an ONNX artifact directory (runtime/contract.py).

Phases: load (safetensors -> models/), trace (export/trace.py: torch.onnx.export, dynamo
exporter, checked against the contract), save (export/save.py: external data, weights
several graphs hold stored once in `shared.data`), validate (export/validate.py), then
manifest.json with the sha256 of every file. Everything is written into a hidden
sibling directory that is renamed onto `--out` only at the end, so a failed or interrupted
export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import sys
import time
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version

from ..runtime.memory import available_memory
from ..runtime import contract as C, manifest as M
from ..runtime.errors import DFlashError, InternalError
from . import sources as S
from ..runtime.lazy import lazy_import
from . import draft_vocab as DV, stream, trace as T
from ..runtime.outdir import check_out_dir, clean_stale, commit, staged, write_manifest_checked
from .options import MAX_CONTEXT
from .progress import Phases, report
from .quant_options import check_kv_cache
from .quantize import check_options, default_block_size, quantize_artifact
from .save import copy_tokenizer, graph_spec, opset_of, save_graphs
from .validate import validate_artifact

torch = lazy_import("torch")  # torch and the reference models: on first use (runtime/lazy.py)
reference = lazy_import("dflash_export.models")
checkpoint = lazy_import("dflash_export.models.checkpoint")
dflash2 = lazy_import("dflash_export.models.dflash2")  # load_draft_config / load_drafter: either family
gdn = lazy_import("dflash_export.models.gdn")
graphs = lazy_import("dflash_export.export.graphs")
kv_calibrate = lazy_import("dflash_export.export.kv_calibrate")
moe_graphs = lazy_import("dflash_export.export.moe")

DTYPES = ("fp32", "fp16", "bf16")
MIN_OPSET = 18


def torch_dtype(dtype: str):
    if dtype not in DTYPES:
        raise DFlashError(f"dtype {dtype!r} is not supported (choose one of {', '.join(DTYPES)})")
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


# -- checks before anything is written ---------------------------------------------------


def plan(target_dir, draft_dir, block_size, mask_token_id, max_context, opset=None, draft_label=None):
    """Read both configs and refuse any mismatch before loading a single weight (messages name
    the drafter as `draft_label`: its id and revision when it came from the Hub)."""
    tc = reference.TargetConfig.load(target_dir)
    dc = dflash2.load_draft_config(draft_dir)
    dc.check_fits(tc, f"drafter {draft_label or draft_dir}")
    k = int(block_size or dc.block_size)
    if k < 2:
        raise DFlashError(f"block size {k} is too small; a block is [anchor, mask, ...] so it needs at least 2")
    if tc.hybrid and k > _chunk():
        raise DFlashError(f"block size {k} is too large for a hybrid target: a call takes at most {_chunk()} positions "
                          "(one delta-rule chunk); pass a smaller --block-size")
    mask = dc.resolve_mask_token_id(mask_token_id)
    if not 0 <= mask < tc.vocab_size:
        raise DFlashError(f"mask token id {mask} is outside the target's vocabulary [0, {tc.vocab_size})")
    if opset is not None and opset < MIN_OPSET:
        raise DFlashError(f"--opset {opset} is not supported: torch's dynamo exporter writes opset {MIN_OPSET} or higher")
    if max_context <= k:
        raise DFlashError(f"--max-context {max_context} must exceed the block size {k}")
    if max_context > tc.max_position_embeddings:  # allowed (RoPE extrapolates), but the model never saw them
        print(f"warning: --max-context {max_context} exceeds the target's max_position_embeddings "
              f"{tc.max_position_embeddings}: positions past it were not trained and may decode poorly", file=sys.stderr)
    return tc, dc, k, mask


def _chunk() -> int:
    return gdn.CHUNK


# -- room: memory and disk, before anything is loaded -----------------------------------

EXPORT_PEAK = 1.3  # export peak RSS / weight bytes: 1.26 measured (bench/export_2gb.py, docs/results.md)
# a MoE target's routed experts are streamed (export/stream.py): peak RSS / the bytes export does
# hold, bf16 checkpoint -> fp32 (its bf16 copy is held while converting): 1.54 measured (bench/moe_export.py)
STREAMED_PEAK = 1.6
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def checkpoint_elements(directory: Path) -> int:
    """Elements of every tensor in a directory's *.safetensors, from their headers (nothing loaded)."""
    total = 0
    for f in sorted(Path(directory).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise DFlashError(f"{f}: unreadable safetensors header ({e})") from None
        for name, t in header.items():
            if name != "__metadata__":
                size = 1
                for d in t.get("shape", []):
                    size *= int(d)
                # MXFP4 (gpt-oss's released experts): two values a byte, each scale byte a block of 32
                total += 2 * size if name.endswith("_blocks") else 0 if name.endswith("_scales") else size
    return total


def check_room(weight_bytes: int, out: Path, dtype: str, streamed: int = 0, disk: int | None = None) -> None:
    """Refuse, with a one-line hint, an export this machine's memory or disk cannot hold:
    better than being killed by the OS half-way (or filling the disk). `streamed`: bytes of
    `weight_bytes` that go from the checkpoint to disk without being held (a MoE's experts);
    `disk`: bytes written beside `out` when not `weight_bytes` (`disk_bytes`)."""
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    smaller = "export with --dtype fp16 or bf16 (half the bytes)" if dtype == "fp32" else "export on a larger machine"
    held = weight_bytes - streamed
    need, avail = int((STREAMED_PEAK if streamed else EXPORT_PEAK) * held), available_memory()
    if avail is not None and need > avail:
        also = f" ({gb(streamed)} of them experts streamed from the checkpoint)" if streamed else ""
        raise DFlashError(f"export needs about {gb(need)} of memory for {gb(weight_bytes)} of {dtype} weights{also}, but only "
                          f"{gb(avail)} is available; {smaller}, free memory, or pass --no-room-check to try anyway")
    free, disk = shutil.disk_usage(out.parent).free, weight_bytes if disk is None else disk
    if disk > free:
        raise DFlashError(f"export writes about {gb(disk)} to {out.parent}, which has {gb(free)} free; "
                          f"free disk space, choose another --out, or {smaller}")


def disk_bytes(weight_bytes: int, streamed: int, dtype: str, quantize, hidden: int, expert_size: int) -> int:
    """About what `export` writes beside `--out`: its float export (`weight_bytes`). With
    --quantize and streamed experts, the float export holds all but the experts and the
    quantized export follows it: the rest again (at most its float size) and the experts
    quantized (bits / 8 bytes a weight, a scale and maybe a zero point a block), or float
    under --draft-only."""
    if quantize is None or not streamed:
        return weight_bytes
    held, elements = weight_bytes - streamed, streamed // BYTES[dtype]
    block = quantize.block_size or default_block_size(quantize.scheme, hidden, expert_size)
    per_weight = quantize.bits / 8 + (BYTES[dtype] + (0 if quantize.symmetric else 1)) / block
    return 2 * held + (int(elements * per_weight) if quantize.target else streamed)


def plan_draft_vocab(n, data, target_dir, vocab_size: int, eos: list[int], family: str = "dflash", own: int | None = None):
    """-> (the N ids or None, the manifest's draft_vocab record or None), before any weight is loaded.
    own: the size of a drafter's own reduced vocabulary (speculators d2t), recorded once loaded."""
    if n is not None and own is not None:
        raise DFlashError(f"--draft-vocab: this drafter scores its own draft vocabulary of {own} tokens (its d2t "
                          "map); leave --draft-vocab out")
    if n is not None and family == "dflash2":
        raise DFlashError("--draft-vocab is not supported for DFlash2 drafters: the candidate selector scores "
                          "full-vocabulary ids; export without it")
    if n is None:
        if data:
            raise DFlashError("--draft-vocab-data needs --draft-vocab N (how many tokens the drafter scores)")
        return None, None
    counts, source = DV.count_tokens(list(data), target_dir, vocab_size) if data else (None, DV.FALLBACK)
    ids = DV.choose(int(n), vocab_size, eos, counts)
    cov = DV.coverage(ids, counts)
    return ids, {"size": int(n), "source": source, "data_coverage": None if cov is None else round(cov, 6),
                 "ids": [int(i) for i in ids]}  # the runtime's q over target ids (rejection sampling)


# -- manifest -----------------------------------------------------------------------------


def hybrid_fields(tc) -> dict:
    """A hybrid target's layer kinds and Gated DeltaNet dims (the contract's LINEAR roles)."""
    if not tc.hybrid:
        return {}
    la = tc.linear
    return dict(target_layer_types=list(tc.layer_types), linear=dict(
        conv_kernel=la.conv_kernel, conv_dim=la.conv_dim, k_heads=la.num_key_heads, v_heads=la.num_value_heads,
        k_dim=la.key_head_dim, v_dim=la.value_head_dim, max_seq=_chunk()))


def windowed_fields(tc) -> dict:
    """A gpt-oss / Gemma 4 target's layer kinds and the record of its attention (contract.window):
    the sliding layers' ring holds the window (their queries see no further back)."""
    w = tc.windowed
    if w is None:
        return {}
    rec = dict(family=w.family, kv_source=list(w.kv_source), sinks=w.sinks, k_eq_v=w.k_eq_v,
               final_logit_softcapping=w.final_logit_softcapping, per_layer_input=w.per_layer_input,
               rope={t: k.rope.kind for t, k in w.kinds.items()}, window=None, ring=None, kv_heads=0, head_dim=0)
    sliding = w.kinds.get("sliding_attention")
    if sliding is not None:
        rec.update(window=sliding.window, ring=sliding.window, kv_heads=sliding.num_kv_heads, head_dim=sliding.head_dim)
    return dict(target_layer_types=list(tc.layer_types), windowed=rec)


def draft_ring(dc, max_context: int) -> int | None:
    """The context ring's slots: the window, when every drafter layer slides and the window is
    shorter than the context (no query then sees further back); else None (slot = position)."""
    w = dc.sliding_window
    if w and all(t == "sliding_attention" for t in dc.layer_types) and w < max_context:
        return int(w)
    return None


def selector_record(dc) -> dict | None:
    """A DFlash 2 drafter's manifest record (contract.selector); None for DFlash 1."""
    if dc.family != "dflash2":
        return None
    return dict(top_k=min(dc.selector_top_k, dc.vocab_size), rank=dc.selector_rank, conv_kernel=dc.conv_kernel_size,
                conv_group=dc.conv_group_size)


def tool_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for pkg in ("dflash-export", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def eos_ids(target_dir: Path, config_eos: list[int]) -> list[int]:
    ids = list(config_eos)
    gen = Path(target_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        for i in [eos] if isinstance(eos, int) else (eos or []):
            if i not in ids:
                ids.append(int(i))
    return ids


# -- the whole export ---------------------------------------------------------------------


def own_vocab_record(drafter) -> dict:
    """The manifest's draft_vocab record of a drafter that brings its own reduced head (speculators)."""
    return {"size": int(drafter.vocab_ids.numel()), "source": "the drafter's own draft vocabulary (speculators d2t)",
            "data_coverage": None, "ids": [int(i) for i in drafter.vocab_ids]}


def export_artifact(
    target_dir: str | Path | S.Source,
    draft_dir: str | Path | S.Source,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    block_size: int | None = None,
    max_context: int = MAX_CONTEXT,
    mask_token_id: int | None = None,
    opset: int | None = None,
    attention: str = "standard",
    force: bool = False,
    progress: bool = True,
    quantize=None,
    room_check: bool = True,
    draft_vocab: int | None = None,
    draft_vocab_data: list | tuple = (),
    moe: str | None = None,
    draft_index: bool = True,
    kv_cache: str | None = None,
    kv_calibration: str | Path | None = None,
) -> M.Manifest:
    """Trace, save, validate and describe one artifact directory; atomic on failure.

    target_dir / draft_dir: directories, Hugging Face ids (`org/name[@revision]`, export/sources.py) or
    resolved Sources; the manifest records where each came from and its weight files' sha256.
    quantize: an export/quantize.py QuantOptions: the float export is written first (to a
    hidden directory), then quantized into `out` (quantize_artifact); streamed experts are
    never written in float: the quantizer reads them from the checkpoint (export/stream.py).
    moe: a mixture-of-experts target's graph form, "op" | "standard" (export/moe.py; None: the
    default for this dtype). draft_index False: draft_block without contract.DRAFT_INDEX, as
    exports before it (tests of older artifacts). kv_cache "int8": the ort flavour's cache quantized
    with per-channel scales calibrated here (export/kv_calibrate.py) from the prompts of
    `kv_calibration` (a file, one a line) or a few seed prompts."""
    out = Path(out_dir).absolute()
    tsrc, dsrc = S.resolve(target_dir, what="target"), S.resolve(draft_dir, what="drafter")
    target_dir, draft_dir = tsrc.path, dsrc.path
    tdtype = torch_dtype(dtype)
    if quantize is not None:
        check_options(quantize, dtype)
    check_out_dir(out, force)
    tc, dc, k, mask = plan(target_dir, draft_dir, block_size, mask_token_id, max_context, opset, dsrc.label)
    moe_path = graph_form(tc, dtype, attention, moe)
    check_kv_cache(kv_cache, attention, kv_calibration)
    if kv_cache is not None:  # the calibration prompts read (and refused) before anything loads
        kv_prompts, kv_source = kv_calibrate.seed_prompts(target_dir, tc.vocab_size, kv_calibration)
    eos = eos_ids(target_dir, tc.eos_token_ids)
    vocab_ids, vocab_record = plan_draft_vocab(draft_vocab, draft_vocab_data, target_dir, tc.vocab_size, eos, dc.family,
                                               dc.draft_vocab_size)
    elements = checkpoint_elements(target_dir) + checkpoint_elements(draft_dir)
    # the Qwen line's experts stream from the checkpoint (export/stream.py); gpt-oss's (transposed,
    # biased, MXFP4 as released) and Gemma 4's load into memory with the rest
    streams = moe_path is not None and tc.windowed is None
    weight_bytes = BYTES[dtype] * (elements + (0 if vocab_ids is None else len(vocab_ids) * tc.hidden_size))
    stale = clean_stale(out)
    if room_check:
        experts_bytes = BYTES[dtype] * stream.expert_elements(target_dir) if streams else 0
        check_room(weight_bytes, out, dtype, experts_bytes,
                   disk_bytes(weight_bytes, experts_bytes, dtype, quantize, tc.hidden_size,
                              tc.moe.expert_size if tc.moe else 0))
    manifest = new_manifest(tc, dc, k, mask, dtype, max_context, eos, attention, vocab_record, moe_path)
    manifest.draft_index = draft_index and manifest.selector is None  # DFlash 2's selector walks every position
    manifest.row_counts = attention == "ort"
    ui = Phases(progress)
    for p in stale:
        ui.console.print(f"removed {p.name}, left by an export that did not finish")
    t0 = time.perf_counter()
    with staged(out, say=ui.console.print) as tmp:  # removed unless published, Ctrl-C too
        with ui.phase("load", f"{tc.architecture} target + {dc.num_layers}-layer drafter ({dtype})"):
            manifest.sources = {"target": tsrc.record(), "draft": dsrc.record()}  # hashes the weight files
            target, drafter, streamed = load_pair(target_dir, draft_dir, dc, tdtype, streams=streams, moe_path=moe_path,
                                                  vocab_ids=vocab_ids, label=dsrc.label)
            if vocab_ids is None and drafter.vocab_ids is not None:
                manifest.draft_vocab = own_vocab_record(drafter)
        kv_scales = None
        if kv_cache is not None:
            with ui.phase("calibrate", f"int8 cache scales over {len(kv_prompts)} prompts ({kv_source})"):
                fp = graphs.wrapper(C.TARGET, target, drafter, attention, manifest.max_context)
                kv_scales = kv_calibrate.calibrate(fp, kv_prompts, manifest.max_context)
                manifest.kv_cache = {"dtype": kv_cache, "scales": "per-channel", "margin": kv_calibrate.MARGIN,
                                     "calibration": {"prompts": len(kv_prompts), "source": kv_source,
                                                     "new_tokens": kv_calibrate.NEW_TOKENS}}
        with ui.phase("trace", f"3 graphs, block size {k} (torch.onnx dynamo)"):
            models = trace_graphs(target, drafter, manifest, tc, tdtype, opset, attention, kv_scales)
            experts = {}
            if streamed:  # the experts' bytes go from the checkpoint to target.data as it is written
                stream_experts(models[C.TARGET], target_dir, tc, moe_path)
                if quantize is not None:  # ... to their quantized form alone: no float copy on disk
                    experts = stream.stand_ins(models[C.TARGET])
        with ui.phase("save", "graphs + external data + tokenizer"):
            shared = save_graphs(tmp, models, dict([C.SHARED_INITIALIZERS[::-1]]) if tc.tie_word_embeddings else {})
            tokenizer = copy_tokenizer(target_dir, tmp)
        manifest.shared = shared
        del models, target, drafter
        with ui.phase("validate", "onnx.checker, shape inference, op lint, ORT load"):
            validate_artifact(tmp, dtype, attention=attention, moe=moe_path)
        manifest = publish(tmp, out, manifest, tokenizer, quantize, progress, experts, t0)
    if quantize is None:
        report(ui, out, time.perf_counter() - t0)
    return manifest


# -- export_artifact's steps ---------------------------------------------------------------


def graph_form(tc, dtype: str, attention: str, moe: str | None) -> str | None:
    """Refuse an attention flavour, dtype or --moe this target cannot export with; the MoE graph
    form to export (export/moe.py; None: no experts)."""
    if attention not in C.ATTENTION_FLAVOURS:
        raise DFlashError(f"--attention must be one of {', '.join(C.ATTENTION_FLAVOURS)} (got {attention!r})")
    if attention == "ort" and tc.family != "dense":
        why = "Gated DeltaNet hybrid" if tc.hybrid else "sliding-window and full attention layers"
        raise DFlashError(f"--attention ort covers Llama/Qwen2/Qwen3 targets; this {tc.architecture} target "
                          f"({why}) exports with --attention standard only")
    if tc.hybrid and dtype == "bf16":
        raise DFlashError("--dtype bf16 is not supported for hybrid (Gated DeltaNet) targets: the runtime's host state "
                          "commit has no bf16 path and ONNX Runtime's CPU provider cannot run bf16; use --dtype fp16")
    if moe is not None and tc.moe is None:
        raise DFlashError(f"--moe {moe}: this {tc.architecture} target has no experts; leave --moe out")
    return moe_graphs.choose_path(moe, dtype, tc.moe.activation) if tc.moe is not None else None


def new_manifest(tc, dc, k: int, mask: int, dtype: str, max_context: int, eos: list[int], attention: str,
                 vocab_record, moe_path: str | None) -> M.Manifest:
    """The manifest as far as the configs say (the graphs, their opset, sources and files come later)."""
    return M.Manifest(
        block_size=k, mask_token_id=mask, target_layer_ids=list(dc.target_layer_ids), dtype=dtype,
        vocab_size=tc.vocab_size, max_context=int(max_context), hidden_size=tc.hidden_size,
        target_layers=tc.num_layers, target_kv_heads=tc.num_kv_heads, target_head_dim=tc.head_dim,
        draft_layers=dc.num_layers, draft_kv_heads=dc.num_kv_heads, draft_head_dim=dc.head_dim,
        architecture=tc.architecture, eos_token_ids=eos,
        opset=0, graphs={}, tools=tool_versions(), attention=attention, draft_vocab=vocab_record, ragged=True, **hybrid_fields(tc),
        **windowed_fields(tc),
        selector=selector_record(dc), draft_ring=draft_ring(dc, max_context),
        moe=moe_graphs.record(tc, moe_path) if moe_path else None,
    )


def load_pair(target_dir: Path, draft_dir: Path, dc, tdtype, *, streams: bool, moe_path: str | None, vocab_ids,
              label: str):
    """The reference target (streamed experts: placeholders, filled at save) and the drafter attached
    to it, with the reduced draft head when one was planned: (target, drafter, streamed)."""
    with checkpoint.experts_on_meta() if streams else contextlib.nullcontext():
        target = reference.Target.from_pretrained(target_dir, dc.target_layer_ids, tdtype)
    streamed = streams and stream.placeholders(target, interleaved=moe_path == "op")
    if moe_path:
        moe_graphs.use_path(target, moe_path)
    drafter = dflash2.load_drafter(draft_dir, tdtype, config=dc)
    drafter.attach(target, f"drafter {label}")
    if vocab_ids is not None:
        drafter.set_draft_vocab(torch.from_numpy(vocab_ids), target.lm_head.weight)
    return target, drafter, streamed


def trace_graphs(target, drafter, manifest: M.Manifest, tc, tdtype, opset: int | None, attention: str,
                 kv_scales: list | None = None) -> dict:
    """The three graphs traced (export/trace.py), shape constants folded, initializers named and stored
    as the runtime reads them."""
    models = {g: T.trace(g, graphs.wrapper(g, target, drafter, attention, manifest.max_context,
                                           ring=manifest.draft_ring, index=C.draft_index(manifest), kv_scales=kv_scales),
                         manifest, tdtype,
                         opset) for g in C.GRAPHS}
    for model in models.values():
        T.fold_shape_constants(model)
        T.rename_initializers(model, tc.tie_word_embeddings)
        # tied embeddings: the head keeps reading the lookup table's bytes
        T.store_transposed(model, keep=C.SHARED_INITIALIZERS[1:] if tc.tie_word_embeddings else ())
    return models


def stream_experts(model, target_dir: Path, tc, moe_path: str) -> None:
    """Point the target graph's expert placeholders at the checkpoint (export/stream.py)."""
    names = stream.attach(model, stream.ExpertReader(target_dir), interleaved=moe_path == "op")
    if len(names) != 2 * len(tc.moe.sparse_layers):  # a placeholder left would be written as zeros
        raise InternalError(f"streamed {len(names)} expert tensors into the target graph, "
                            f"expected {2 * len(tc.moe.sparse_layers)}")


def publish(tmp: Path, out: Path, manifest: M.Manifest, tokenizer, quantize, progress: bool,
            experts: dict | None = None, started: float | None = None) -> M.Manifest:
    """Describe the validated graphs in the manifest and move the staging folder onto `out`; with
    `quantize` the float export is the quantizer's input and only the quantized one is published
    (`experts`: the streamed experts its target holds stand-ins of, export/stream.py `stand_ins`)."""
    manifest.graphs = {name: graph_spec(tmp / f) for name, f in C.GRAPH_FILES.items()}
    manifest.opset = opset_of(tmp / C.GRAPH_FILES[C.TARGET])
    manifest.tokenizer = "tokenizer.json" in tokenizer or "tokenizer.model" in tokenizer
    write_manifest_checked(tmp, manifest)
    if quantize is None:
        commit(tmp, out)
        return manifest
    return quantize_artifact(tmp, out, quantize, force=True, progress=progress, experts=experts, started=started)
