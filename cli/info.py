"""`dflash-export info OUT`: what an exported directory is, at a glance (torch-free).

Reads the manifest (refusing a format version this dflash-export does not know), lists
the pair and where it came from (Hugging Face id and commit, or directory; weight hashes), the export settings (attention flavour included), every graph's inputs and outputs with the role of each dim
(runtime/contract.py), the files and their sizes, and whether the files match their
sha256 in the manifest (checked unless --no-verify).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from ..runtime import contract as C, manifest as M, settings as S
from ..runtime.controller import Costs, auto_policy, default_costs, describe_auto
from ..runtime.memory import human, run_memory
from ..runtime.errors import DFlashError


def describe(out: Path, verify: bool = True) -> dict:
    """The information `info` prints, as one JSON-ready dict."""
    m = M.load_manifest(out, verify=False)
    if not verify:
        hashes = "not checked"
    else:
        try:
            M.verify_files(out, m)
            hashes = "verified"
        except DFlashError as e:
            hashes = f"MISMATCH: {e}"
    graphs = {}
    for g in C.GRAPHS:
        ins, outs = C.io(g, m)
        row = lambda t: {"name": t.name, "dims": list(t.dims), "shape": _shape(t, m), "dtype": C.dtype(t, m)}  # noqa: E731
        graphs[g] = {"file": C.GRAPH_FILES[g], "inputs": [row(t) for t in ins], "outputs": [row(t) for t in outs]}
    files = {rel: (out / rel).stat().st_size for rel in sorted(m.files) if (out / rel).is_file()}
    return {
        "directory": str(out),
        "format": m.format, "format_version": m.format_version,
        "target": {"architecture": m.architecture, "layers": m.target_layers, "hidden_size": m.hidden_size,
                   "kv_heads": m.target_kv_heads, "head_dim": m.target_head_dim, "vocab_size": m.vocab_size,
                   **attention_kinds(m)},
        "drafter": {"layers": m.draft_layers, "kv_heads": m.draft_kv_heads, "head_dim": m.draft_head_dim,
                    "target_layer_ids": m.target_layer_ids, "mask_token_id": m.mask_token_id,
                    "family": "dflash2" if C.selector(m) else "dflash", "selector": C.selector(m)},
        "dtype": m.dtype, "attention": C.flavour(m), "block_size": m.block_size, "max_context": m.max_context, "opset": m.opset,
        "eos_token_ids": m.eos_token_ids, "tokenizer": m.tokenizer,
        "graphs": graphs,
        "shared": {n: asdict(t) for n, t in m.shared.items()},
        "files": files, "total_bytes": sum(files.values()),
        "hashes": hashes,
        "engines": m.engines,
        "tools": m.tools,
        "sources": m.sources,
        "runtime": runtime_choices(out, m.block_size),
        "moe": m.moe,
        "kv_cache": m.kv_cache,
        "quantization": m.quantization and {k: v for k, v in m.quantization.items() if k != "weights"},
        "memory": memory_needed(out, m),
    }


def memory_needed(out: Path, m) -> dict:
    """About what a run holds (runtime/memory.py `run_memory`), with the drafter (speculative) and
    without (plain), at the calibrated prefill chunk (or the default); a bad runtime.json: the default."""
    try:
        chunk = S.load_settings(out, S.device_key("ort", "cpu")).prefill_chunk or S.DEFAULT_CHUNK
    except DFlashError:
        chunk = S.DEFAULT_CHUNK
    return {"speculative": run_memory(out, m, chunk=chunk), "plain": run_memory(out, m, drafter=False, chunk=chunk)}


def attention_kinds(m) -> dict:
    """The target's family and, per kind of layer, which layers and what their cache is."""
    types = m.target_layer_types or [C.ATTENTION] * m.target_layers
    w = C.window(m) or {}
    traits = [name for name, present in (("hybrid", m.linear_layers), ("mixture-of-experts", m.moe)) if present]
    family = w.get("family") or " ".join(traits) or "dense"  # a mixture of experts is not dense
    kinds: dict = {}
    for i, (t, kind) in enumerate(zip(types, C.layer_kinds(C.TARGET, m))):
        k = kinds.setdefault(t, {"layers": []})
        k["layers"].append(i)
        if kind == C.SLIDING:
            k.update(window=w["window"], cache=f"ring of {w['ring']} slots", kv_heads=w["kv_heads"], head_dim=w["head_dim"])
        elif kind == C.ATTENTION:
            k.update(cache="one slot per position", kv_heads=m.target_kv_heads, head_dim=m.target_head_dim)
        elif kind == C.LINEAR:
            k.update(cache="Gated DeltaNet state")
    for t, r in (w.get("rope") or {}).items():
        kinds[t]["rope"] = r
    extra = {"kv_shared": {i: j for i, j in enumerate(w["kv_source"]) if i != j}} if w.get("kv_source") else {}
    if w:
        extra.update(sinks=w.get("sinks", False), final_logit_softcapping=w.get("final_logit_softcapping"))
    if m.moe:  # the experts: how many, routed how, in which graph form (export/moe.py)
        extra["experts"] = {k: m.moe.get(k) for k in ("experts", "top_k", "activation", "path")}
    return {"family": family, "attention_kinds": kinds, **extra}


def runtime_choices(out: Path, block: int) -> dict:
    """{device key: the calibrated choices in runtime.json (threads, spinning, verify policy, what
    `--speculation auto` does with its costs)}; {} when not calibrated; a bad file: {"error": ...}."""
    try:
        keys = S.calibrated_devices(out)
        entries = {k: S.load_settings(out, k) for k in keys}
    except DFlashError as e:
        return {"error": str(e)}
    choices = {}
    for k, s in entries.items():
        costs = Costs.from_json(s.costs) if s.costs else default_costs(block)
        policy = auto_policy(costs, block)
        choices[k] = {"threads": s.threads, "spin": s.spin, "spin_us": s.spin_us if s.spin else None, "verify": S.policy_json(s.verify), "costs": costs.source,
                      "auto_policy": policy, "auto": describe_auto(policy, costs.source)}
    return choices


def source_line(rec: dict) -> str:
    """A manifest's record of one model, in a line: id, revision and commit (or directory), weight hashes."""
    where = rec.get("id") or rec.get("path") or "?"
    if rec.get("id"):
        asked = f", revision {rec['revision']}" if rec.get("revision") and rec["revision"] != rec.get("commit") else ""
        where += f" at commit {rec['commit']}{asked}" if rec.get("commit") else asked
    files = rec.get("files") or {}
    hashes = ", ".join(f"{name} sha256 {digest[:12]}" for name, digest in sorted(files.items())[:3])
    more = f" (+{len(files) - 3} more)" if len(files) > 3 else ""
    return f"{where}; {hashes}{more}" if files else where


def moe_line(e: dict, q: dict | None) -> str:
    """A manifest's `moe` record in a line: routing, shared expert, MoE layers and the graph form."""
    norm = "renormalised" if e["norm_topk_prob"] else "not renormalised"
    shared = f"shared expert of width {e['shared_expert_size']} (sigmoid-gated)" if e["shared_expert_size"] else \
        "no shared expert"
    experts = q if q and q.get("target", True) else None  # --draft-only leaves the experts as exported
    if e["path"] == "op":
        op = f"QMoE {q['scheme']}, block {q['block_size']}" if experts else "MoE"
        path = f"op (com.microsoft::{op}: ONNX Runtime only)"
    elif experts:
        path = (f"standard (gathered experts in ai.onnx ops: {q['scheme']} codes, block {q['block_size']}, "
                "dequantized after the gather)")
    else:
        path = "standard (gathered experts in ai.onnx ops)"
    return (f"{e['experts']} experts of width {e['expert_size']}, top {e['top_k']} ({norm}), {shared}; "
            f"MoE in layers {e['layers']}; path {path}")


def quant_line(q: dict) -> str:
    """A manifest's `quantization` record in a line: what is quantized, how, and what stayed float."""
    if q.get("target", True):
        hb = q.get("head_bits")
        at = f" ({hb}-bit)" if hb and hb != q.get("bits") else ""  # --quant-head-bits: the vocabulary table's own bits
        what = ["target linear layers"] + [w for key, w in (("experts", "routed experts"), ("lm_head", f"LM head{at}"),
                                                            ("embedding", f"embedding lookup{at}"),
                                                            ("draft", "drafter linear layers")) if q.get(key)]
    else:
        what = ["drafter's graphs and its own LM head (the target stays as exported)"]
    level = q.get("accuracy_level")
    return (f"{q['scheme']} weight-only, block {q['block_size']}, {'symmetric' if q.get('symmetric') else 'zero points'}"
            + (f", MatMulNBits accuracy level {level} ({q.get('accuracy_level_from', 'recorded')})" if level is not None else "")
            + ": " + ", ".join(what))


def _shape(t: C.Tensor, m) -> list:
    static = C.sizes(m)
    return [r if r in C.DYNAMIC else static[r] for r in t.dims]


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print everything as one JSON object.")
@click.option("--no-verify", is_flag=True, help="Skip hashing the files (fast on big exports).")
def info(out, as_json, no_verify):
    """What OUT is: format version, target and drafter, dtype, block size, max context,
    every graph's inputs and outputs, file sizes, and whether the hashes match."""
    d = describe(out, verify=not no_verify)
    if as_json:
        click.echo(json.dumps(d, indent=1))
    else:
        print_info(d, out)
    if d["hashes"].startswith("MISMATCH"):
        raise DFlashError(d["hashes"][len("MISMATCH: "):])


def print_info(d: dict, out: Path) -> None:
    t, dr = d["target"], d["drafter"]
    click.echo(f"{d['directory']}: {d['format']} format version {d['format_version']}")
    click.echo(f"target   {t['architecture']} ({t['family']}), {t['layers']} layers, hidden {t['hidden_size']}, "
               f"{t['kv_heads']} kv heads x {t['head_dim']}, vocab {t['vocab_size']}")
    for name, k in t["attention_kinds"].items():
        what = ", ".join(f"{key.replace('_', ' ')} {k[key]}" for key in ("window", "kv_heads", "head_dim", "rope") if key in k)
        click.echo(f"  {name:<17} {len(k['layers'])} layer(s) {k['layers']}: {k['cache']}" + (f", {what}" if what else ""))
    notes = [f"KV-sharing layers {sorted(t['kv_shared'])} read layers {sorted(set(t['kv_shared'].values()))}"
             if t.get("kv_shared") else "", "attention sinks" if t.get("sinks") else "",
             f"logits soft-capped at {t['final_logit_softcapping']:g}" if t.get("final_logit_softcapping") else "",
             "{experts} experts, top {top_k}, {activation} ({path} ops)".format(
                 **{**t["experts"], "activation": t["experts"]["activation"] or "swiglu",
                    "path": "ONNX Runtime's MoE" if t["experts"]["path"] == "op" else "standard"})
             if t.get("experts") else ""]
    if any(notes):
        click.echo("  " + "; ".join(n for n in notes if n))
    sel = dr.get("selector")
    kind = f"DFlash 2 (candidate selector: top {sel['top_k']}, rank {sel['rank']}), " if sel else ""
    click.echo(f"drafter  {kind}{dr['layers']} layer(s), {dr['kv_heads']} kv heads x {dr['head_dim']}, "
               f"taps {dr['target_layer_ids']}, mask token {dr['mask_token_id']}")
    flavour = {"ort": "ort (target attention as com.microsoft GroupQueryAttention: ONNX Runtime only)"}
    for key, what in (("target", "from     target"), ("draft", "from     drafter")):
        rec = (d.get("sources") or {}).get(key)
        if rec:
            click.echo(f"{what} {source_line(rec)}")
    click.echo(f"export   {d['dtype']}, attention {flavour.get(d['attention'], d['attention'])}, block size {d['block_size']}, max context {d['max_context']}, opset {d['opset']}, "
               f"eos {d['eos_token_ids']}, tokenizer {'yes' if d['tokenizer'] else 'no'}")
    kv = d.get("kv_cache")
    if kv:
        cal = kv.get("calibration") or {}
        click.echo(f"kv cache {kv['dtype']}, {kv['scales']} scales (static: absmax x {kv['margin']:g} over "
                   f"{cal.get('prompts', '?')} prompts of {cal.get('source', '?')} + {cal.get('new_tokens', '?')} generated tokens)")
    if d["quantization"]:
        click.echo(f"quant    {quant_line(d['quantization'])}")
    if d["moe"]:
        click.echo(f"experts  {moe_line(d['moe'], d['quantization'])}")
    m = M.load_manifest(out, verify=False)
    if m.rows_vary:  # Manifest.rows_vary: the last bits of a position alone vs in a verify block
        click.echo(f"lossless speculative == plain except at near-ties of the top two logits: the {' and '.join(m.rows_vary)} "
                   "compute a position alone and in a verify block in different orders (docs/quantization.md)")
    for g in C.GRAPHS:
        graph = C.spec(g, m)  # the ort attention flavour declares its own target graph
        kinds = C.layer_kinds(g, m)  # hybrid targets: linear-attention layers carry states, not K/V
        click.echo(f"{graph.file}  ({len(d['graphs'][g]['inputs'])} inputs, {len(d['graphs'][g]['outputs'])} outputs)")
        for kind, tensors in (("in", graph.inputs), ("out", graph.outputs)):
            for t in tensors:
                layers = [i for i, k in enumerate(kinds) if k == t.kind]
                if t.per_layer and not layers:
                    continue
                dims = ", ".join(str(x) for x in _shape(t, m))
                each = (f"  i < {len(kinds)}" if len(layers) == len(kinds) else f"  i in {layers}") if t.per_layer else ""
                click.echo(f"  {kind:<4} {t.name:<22} [{dims}] {C.dtype(t, m)}{each}")
    shared = d["shared"]
    if shared:
        once = {(s["file"], s["offset"]): s["length"] for s in shared.values()}
        click.echo(f"shared   {len(shared)} weight names stored once in {C.SHARED_DATA} ({human(sum(once.values()))})")
    click.echo("files    " + ", ".join(f"{k} {human(v)}" for k, v in d["files"].items()))
    click.echo(f"total    {human(d['total_bytes'])}")
    r, p = d["memory"]["speculative"], d["memory"]["plain"]
    click.echo(f"memory   a run needs about {human(r['total'])} ({human(p['total'])} without the drafter): weights "
               f"{human(r['weights'])} once ONNX Runtime has packed them, KV cache {human(r['kv_cache'])} per sequence at max "
               f"context {r['max_context']} (resident as a sequence fills it), working memory about {human(r['work'])} "
               f"for prefill chunks of {r['chunk']}, runtime {human(r['runtime'])}")
    click.echo(f"hashes   {d['hashes']}")
    if d["engines"]:
        click.echo(f"engines  TensorRT build record present ({', '.join(sorted(d['engines']))})")
    runtime = d["runtime"]
    if not runtime:
        click.echo("runtime  not calibrated (full-block verify; auto with the default cost model): "
                   "dflash-export bench --calibrate")
    elif "error" in runtime:
        click.echo(f"runtime  {runtime['error']}")
    for key, r in runtime.items() if "error" not in runtime else ():
        verify = S.describe_policy(None if r["verify"] == "full" else S.VerifyPolicy(**r["verify"]))
        spin = (f", workers spin up to {r['spin_us']} us" if r.get("spin_us") else ", workers spin") if r["spin"] else ""
        click.echo(f"runtime  {key}: threads {r['threads'] or 'default'}{spin}, verify {verify}; {r['auto']}")


COMMANDS = [info]
