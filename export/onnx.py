"""Export a target + drafter pair to an ONNX artifact directory (runtime/contract.py).

Phases: load (safetensors -> models/), trace (torch.onnx.export, dynamo exporter), save
(external data: one `<graph>.data` per graph plus `shared.data` holding the embedding
and LM head once for target.onnx and draft_block.onnx), validate (export/validate.py),
then manifest.json with the sha256 of every file. Everything is written into a hidden
sibling directory that is renamed onto `--out` only at the end, so a failed or interrupted
export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import sys
import time
import warnings
from pathlib import Path

from ..runtime import contract as C
from ..runtime.errors import DFlashError

DTYPES = ("fp32", "fp16", "bf16")
SHARED_DATA = "shared.data"
ALIGN = 4096  # external-data offsets of large tensors, so ORT can mmap them
MIN_OPSET = 18
INLINE_BELOW = 1024  # bytes: smaller initializers stay in the .onnx file


def torch_dtype(dtype: str):
    import torch

    if dtype not in DTYPES:
        raise DFlashError(f"dtype {dtype!r} is not supported (choose one of {', '.join(DTYPES)})")
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]


class Phases:
    """One status line per phase on stderr (rich), then its time and the process's peak RSS
    so far (where memory goes on big models); silent when disabled."""

    def __init__(self, enabled: bool):
        from rich.console import Console

        self.console = Console(stderr=True, quiet=not enabled)

    @contextlib.contextmanager
    def phase(self, name: str, what: str):
        t0 = time.perf_counter()
        with self.console.status(f"[bold]{name}[/] {what}"):
            yield
        rss = human(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
        self.console.print(f"[green]done[/] {name:<9} {what} ({time.perf_counter() - t0:.1f} s, peak RSS {rss})")


# -- checks before anything is written ---------------------------------------------------


def check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"--out {out} exists and is not empty; pass --force to replace it or choose another path")
    if not out.parent.exists():
        raise DFlashError(f"the parent directory of --out {out} does not exist; create it first")


def plan(target_dir, draft_dir, block_size, mask_token_id, max_context, opset=None):
    """Read both configs and refuse any mismatch before loading a single weight."""
    from ..models.config import DraftConfig, TargetConfig

    tc = TargetConfig.load(target_dir)
    dc = DraftConfig.load(draft_dir)
    dc.check_fits(tc, f"drafter {draft_dir}")
    k = int(block_size or dc.block_size)
    if k < 2:
        raise DFlashError(f"block size {k} is too small; a block is [anchor, mask, ...] so it needs at least 2")
    mask = dc.resolve_mask_token_id(mask_token_id)
    if not 0 <= mask < tc.vocab_size:
        raise DFlashError(f"mask token id {mask} is outside the target's vocabulary [0, {tc.vocab_size})")
    if opset is not None and opset < MIN_OPSET:
        raise DFlashError(f"--opset {opset} is not supported: torch's dynamo exporter writes opset {MIN_OPSET} or higher")
    if max_context <= k:
        raise DFlashError(f"--max-context {max_context} must exceed the block size {k}")
    return tc, dc, k, mask


# -- tracing ------------------------------------------------------------------------------


def trace(module, args, dynamic_shapes, names, opset: int | None):
    """torch.onnx.export (dynamo) -> onnx_ir.Model with the contract's tensor names."""
    import torch

    inputs, outputs = names
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            prog = torch.onnx.export(
                module.eval(), args, dynamo=True, input_names=inputs, output_names=outputs,
                dynamic_shapes=dynamic_shapes, opset_version=opset, optimize=False, verbose=False,
            )
    except Exception as e:  # the exporter raises many types; report one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DFlashError(f"torch.onnx.export failed for {type(module).__name__}: {type(e).__name__}: {first}") from e
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    model = prog.model
    got = model.opset_imports.get("")
    if opset is not None and got != opset:
        raise DFlashError(f"--opset {opset}: the exporter could only produce opset {got} for this model; "
                          "use --opset 18 or higher (or leave it out)")
    got_in = [v.name for v in model.graph.inputs]
    got_out = [v.name for v in model.graph.outputs]
    if got_in != inputs or got_out != outputs:
        raise DFlashError(f"exported {type(module).__name__} has I/O {got_in} -> {got_out}, expected {inputs} -> {outputs}")
    return model


def fold_shape_constants(model) -> None:
    """Fold computations on constants (shape and axes arithmetic) but never touch a weight.

    The exporter leaves e.g. ReduceMean axes as Reshape(Constant, Constant); TensorRT's
    parser wants such inputs as initializers. onnxscript's full optimizer would also fold
    Transpose(weight) into new unnamed copies (for small weights only), which would break
    the shared embedding/LM head names, so any node that reads an initializer is skipped.
    """
    from onnxscript import optimizer

    weights = set(model.graph.initializers)

    def should_fold(node):
        return False if any(v is not None and v.name in weights for v in node.inputs) else None

    optimizer.fold_constants(model, should_fold=should_fold)
    optimizer.remove_unused_nodes(model)


def rename_initializers(model, tied: bool) -> None:
    """Drop the wrapper prefix; the embedding and LM head get the SHARED_INITIALIZERS names.

    With tied embeddings torch.export keeps one parameter for both uses; it is split into
    two initializers, `embed_tokens.weight` (read by Gather) and `lm_head.weight` (read by
    the head's MatMul), that point at the same bytes of shared.data, so every graph that
    holds the shared tensors holds both names.
    """
    import onnx_ir as ir

    embed, head = C.SHARED_INITIALIZERS
    for value in list(model.graph.initializers.values()):
        prefix, _, rest = value.name.partition(".")
        name = rest if prefix in ("target", "drafter", "shared") and rest else value.name
        if name.endswith("embed_tokens.weight") or (tied and name.endswith("lm_head.weight")):
            name = embed
        elif name.endswith("lm_head.weight"):
            name = head
        value.name = name
    if tied and embed in model.graph.initializers and head not in model.graph.initializers:
        tied_value = model.graph.initializers[embed]
        head_value = ir.Value(name=head, shape=tied_value.shape, type=tied_value.type, const_value=tied_value.const_value)
        model.graph.register_initializer(head_value)
        for node, i in list(tied_value.uses()):
            if node.op_type != "Gather":
                node.replace_input_with(i, head_value)


# -- saving -------------------------------------------------------------------------------


class DataWriter:
    """Moves initializers of 1 KiB and more into external data; SHARED_INITIALIZERS into shared.data, once.

    Tensors are streamed from their torch storage one at a time (no copy of the model),
    which keeps peak memory near the weights' size even above protobuf's 2 GB limit.
    """

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, object] = {}
        self.shared: dict[str, tuple] = {}  # name -> (offset, length, dtype, shape)

    def _append(self, fname: str, tensor) -> tuple[int, int]:
        f = self.files.get(fname)
        if f is None:
            f = self.files[fname] = open(self.root / fname, "wb")
        nbytes = tensor.nbytes
        pos = f.tell()
        pad = (-pos) % (ALIGN if nbytes >= ALIGN else 64)
        f.write(b"\0" * pad)
        offset = f.tell()
        tensor.tofile(f)
        length = f.tell() - offset
        if length != nbytes:
            raise DFlashError(f"writing {tensor.name}: wrote {length} bytes, expected {nbytes}")
        return offset, length

    def externalize(self, graph: str, model, tied: bool) -> None:
        import onnx_ir as ir

        for value in list(model.graph.initializers.values()):
            t = value.const_value
            if value.name in C.SHARED_INITIALIZERS:
                fname = SHARED_DATA
                key = C.SHARED_INITIALIZERS[0] if tied else value.name  # tied: one tensor, two names
                if key not in self.shared:
                    self.shared[key] = (*self._append(fname, t), t.dtype, tuple(t.shape))
                offset, length, dtype, shape = self.shared[key]
                if (dtype, shape) != (t.dtype, tuple(t.shape)):
                    raise DFlashError(f"shared tensor {value.name} differs between graphs: {shape} vs {tuple(t.shape)}")
            elif t.nbytes < INLINE_BELOW:
                continue  # shape constants (axes, shapes) stay inline, where shape inference reads them
            else:
                fname = f"{graph}.data"
                offset, length = self._append(fname, t)
            value.const_value = ir.ExternalTensor(
                fname, offset, length, t.dtype, shape=t.shape, name=value.name, base_dir=self.root
            )

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def save_graph(model, path: Path) -> None:
    import onnx
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)  # initializers are external references: small
    for node in proto.graph.node:  # the exporter's per-node stack traces: most of the file, no use
        del node.metadata_props[:]
        node.doc_string = ""
    onnx.save_model(proto, str(path))


def copy_tokenizer(target_dir: Path, out: Path) -> list[str]:
    copied = []
    for name in C.TOKENIZER_FILES:
        src = Path(target_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    return copied


# -- manifest -----------------------------------------------------------------------------


def graph_spec(path: Path) -> C.GraphSpec:
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)

    def spec(v) -> C.TensorSpec:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
        name = helper.tensor_dtype_to_np_dtype(t.elem_type).name
        return C.TensorSpec(v.name, name if name != "bfloat16" else "bfloat16", dims)

    return C.GraphSpec(path.name, [spec(v) for v in model.graph.input], [spec(v) for v in model.graph.output])


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in ("dflash-export", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def opset_of(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def eos_ids(target_dir: Path, config_eos: list[int]) -> list[int]:
    import json

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


def export_artifact(
    target_dir: str | Path,
    draft_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "fp32",
    block_size: int | None = None,
    max_context: int = 2048,
    mask_token_id: int | None = None,
    opset: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> C.Manifest:
    """Trace, save, validate and describe one artifact directory; atomic on failure."""
    from . import graphs as G
    from .validate import validate_artifact

    target_dir, draft_dir, out = Path(target_dir), Path(draft_dir), Path(out_dir).absolute()
    tdtype = torch_dtype(dtype)
    check_out_dir(out, force)
    tc, dc, k, mask = plan(target_dir, draft_dir, block_size, mask_token_id, max_context, opset)
    ui = Phases(progress)
    t0 = time.perf_counter()
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        with ui.phase("load", f"{tc.architecture} target + {dc.num_layers}-layer drafter ({dtype})"):
            from ..models import Drafter, Target

            target = Target.from_pretrained(target_dir, dc.target_layer_ids, tdtype)
            drafter = Drafter.from_pretrained(draft_dir, tdtype)
        models = {}
        with ui.phase("trace", f"3 graphs, block size {k} (torch.onnx dynamo)"):
            models[C.TARGET] = trace(G.TargetGraph(target), *G.target_inputs(target, k), G.target_names(tc.num_layers), opset)
            models[C.DRAFT_CONTEXT] = trace(
                G.DraftContextGraph(drafter), *G.context_inputs(drafter, k), G.context_names(dc.num_layers), opset
            )
            models[C.DRAFT_BLOCK] = trace(
                G.DraftBlockGraph(drafter, target), *G.block_inputs(drafter, target, k, mask),
                G.block_names(dc.num_layers), opset,
            )
        with ui.phase("save", "graphs + external data + tokenizer"):
            writer = DataWriter(tmp)
            try:
                for name, model in models.items():
                    fold_shape_constants(model)
                    rename_initializers(model, tc.tie_word_embeddings)
                    writer.externalize(name, model, tc.tie_word_embeddings)
                    save_graph(model, tmp / C.GRAPH_FILES[name])
            finally:
                writer.close()
            tokenizer = copy_tokenizer(target_dir, tmp)
        del models, target, drafter, writer
        with ui.phase("validate", "onnx.checker, shape inference, op lint, ORT load"):
            validate_artifact(tmp, dtype)
        specs = {name: graph_spec(tmp / f) for name, f in C.GRAPH_FILES.items()}
        manifest = C.Manifest(
            block_size=k,
            mask_token_id=mask,
            target_layer_ids=list(dc.target_layer_ids),
            dtype=dtype,
            vocab_size=tc.vocab_size,
            max_context=int(max_context),
            hidden_size=tc.hidden_size,
            target_layers=tc.num_layers,
            target_kv_heads=tc.num_kv_heads,
            target_head_dim=tc.head_dim,
            draft_layers=dc.num_layers,
            draft_kv_heads=dc.num_kv_heads,
            draft_head_dim=dc.head_dim,
            architecture=tc.architecture,
            eos_token_ids=eos_ids(target_dir, tc.eos_token_ids),
            opset=opset_of(tmp / C.GRAPH_FILES[C.TARGET]),
            graphs=specs,
            tools=tool_versions(),
            tokenizer="tokenizer.json" in tokenizer or "tokenizer.model" in tokenizer,
        )
        write_manifest_checked(tmp, manifest)
        commit(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt):
            ui.console.print(f"[red]interrupted[/]: partial export removed, {out} unchanged")
        raise
    report(ui, out, time.perf_counter() - t0)
    return manifest


def write_manifest_checked(root: Path, manifest: C.Manifest) -> None:
    C.write_manifest(root, manifest)
    C.load_manifest(root, verify=True)  # what a runtime will do: must pass before we publish


def commit(tmp: Path, out: Path) -> None:
    """Move the finished directory onto `out` (replacing an old one only now)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def report(ui: Phases, out: Path, seconds: float) -> None:
    from rich.table import Table

    table = Table(title=f"{out} ({seconds:.1f} s)", title_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    total = 0
    for p in sorted(out.iterdir()):
        total += p.stat().st_size
        table.add_row(p.name, human(p.stat().st_size))
    table.add_row("[bold]total", f"[bold]{human(total)}")
    ui.console.print(table)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
