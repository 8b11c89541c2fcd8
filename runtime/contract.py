"""The artifact contract between `export/` and `runtime/`: graphs, tensors, names, dims.

The manifest that records one export of it is `runtime/manifest.py`.

Everything a runtime needs to know about an exported directory is declared here, as
data: `GRAPHS` lists, per graph, its ordered inputs and outputs with the role of every
dim and the dtype. The exporter traces to these names and checks the graphs against
them, the backends bind by them, the check and the lint read them; nothing else spells
a tensor name or a dim table.

    target          prefill and verify share one graph (dynamic seq)
    draft_context   projects newly accepted target taps into drafter K/V (dynamic ctx)
    draft_block     one denoising pass over the block (static block size K)

Per-layer tensors are templates (`past_key.{i}`); `io(graph, m)` expands them in order
k0 v0 k1 v1 ... for the manifest's layer counts. A template belongs to one kind of layer:
hybrid targets (Qwen3.5 / 3.6, `target_layer_types` in the manifest) carry, for each
`linear_attention` layer i, its Gated DeltaNet state instead of K/V (docs/hybrid.md):

    in   conv_state.{i}  [batch, conv_window, conv_dim]   model    (last conv inputs)
         rec_state.{i}   [batch, v_heads, k_dim, v_dim]   float32  (delta-rule state)
    out  new_conv.{i}    [batch, seq, conv_dim]           model    (conv inputs of the new positions)
         delta_k.{i}     [batch, seq, k_heads, k_dim]     model    (l2-normed keys)
         delta_u.{i}     [batch, seq, v_heads, v_dim]     float32  (delta-rule corrections)
         delta_g.{i}     [batch, seq, v_heads]            float32  (log decays)

The runtime commits n positions (runtime/hybrid.py): conv_state = last conv_window rows of
[conv_state; new_conv[:n]], rec_state = exp(c_n) rec_state + sum_{j<n} exp(c_n - c_j) k_j u_j^T
with c = cumsum(g); rollback after a rejected draft is, as for K/V, committing fewer.
A hybrid target call takes at most `linear["max_seq"]` positions (one delta-rule chunk). The drafter's context cache holds every
position before the anchor, so `past_ctx` equals the anchor's position.

Weights stored once for several graphs live in `shared.data` and are listed in the
manifest's `shared` table (file, offset, length, dtype, shape, graphs): the target's
embedding and LM head (target + draft_block, as `SHARED_INITIALIZERS`; tied embeddings
are two names over the same bytes) and the drafter weights both drafter graphs read
(the K/V projections). Each graph's other weights are in `<graph>.data`.

Attention flavours (`Manifest.attention`, `export --attention`): "standard" (the default,
the only TensorRT input) keeps every graph in standard ai.onnx ops with a sequence-major
cache the runtime grows by binding; "ort" exports the target with ONNX Runtime's
com.microsoft GroupQueryAttention, whose head-major cache `[1, Hkv, max_context, D]` is
one buffer bound as both past and present and updated in place (`TARGET_ORT`): a step's
cost then barely grows with the context. The drafter graphs are the same in both. Its
inputs carry each row's count of new tokens implicitly (`Manifest.row_counts`, `row_counts`):
seqlens_k = the row's length + count - 1 and position_ids from the row's length, so a batch's
rows verify different lengths in one call; older exports run such rows one call each.
Its cache may be int8 (`Manifest.kv_cache`, `export --kv-cache int8`; the tensors' dtype
`CACHE`): GroupQueryAttention stores K (after rotary) and V as round(x / scale) with static
per-channel scales [Hkv, 1, D] held in target.onnx (its inputs k_scale / v_scale) and
dequantizes as it reads; the runtime only allocates, binds and copies the int8 buffers.

Ragged batches (`Manifest.ragged`, every export since batching; docs/batching.md): each
row of a batch has its own positions, valid cache length and number of new tokens. The
standard flavour's caches are then position-major, `[max_context, max_batch, Hkv, D]`
per layer, so the valid prefix of ALL rows (`[P, B, Hkv, D]`, P the longest row) is one
contiguous view bound without a copy, and a row's slots past its own length are masked
(`past_lengths` / `ctx_lengths`). New K/V come out `[B, S, ...]` and the runtime writes
each row's at its own length. For one row this is the same memory as `[1, P, Hkv, D]`.
`logits_index` `[B, N]` picks the positions whose logits (and argmax) the target
computes: a prefill asks for its last position only, a verify for all of them. Manifests
without `ragged` (older exports) keep the batch-1 graphs (`GRAPHS`) and run batch 1 only.

Sliding-window targets (gpt-oss, Gemma 4: `Manifest.windowed`; docs/windowed.md): a
`sliding_attention` layer i keeps a ring of `windowed["ring"]` slots per row, position t in
slot t mod ring, batch-major, in its kind's shape (Gemma 4's full layers have their own):

    in   past_key.{i}  [batch, window_past, window_kv_heads, window_head_dim]  (ring slots, <= ring)
    out  new_key.{i}   [batch, seq, window_kv_heads, window_head_dim]          (the new positions)

The graph finds each slot's position from `past_lengths` (the newest position congruent to
the slot below the row's length); the runtime writes only committed positions into the ring
(runtime/window.py), so a rejected draft never overwrites a slot still in the window, and the
ring's memory does not grow with the context. A KV-sharing layer (`windowed["kv_source"]`)
carries no cache tensors: it attends to an earlier layer's K/V inside the graph.

Draft heads over the drafts used (`Manifest.draft_index`, every export since it): draft_block takes
`draft_index` [n], the draft positions (0..K-2) whose hidden states its LM head scores, and returns
draft_ids / draft_logits / draft_conf for those n positions only. The loop passes 0..n-1 with n + 1
the longest verify it will run this round (decided before the draft: the controller's lengths,
the room left), so a verify of s positions pays the head for s - 1 drafts, not K - 1: at a large
vocabulary the head is a large share of a draft call (Qwen3-30B-A3B's shape: a call scoring one
draft costs about 0.55x one scoring 15, docs/results.md). Manifests without it (older exports) score every
draft position (`DRAFT_BLOCK_ALL`).

All-sliding drafters (`Manifest.draft_ring`): the context cache is a ring, position t in slot t mod
ring, `past_ctx` <= ring, slot positions found from `ctx_lengths` (runtime/ort/row_cache.py). DFlash 2
drafters (`Manifest.selector`): draft_block also returns `SELECTOR_OUTPUTS`.

`runtime.json` (runtime/settings.py: measured threads, verify policy) may sit beside the
manifest: it is the one file the hash check allows without listing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import DFlashError

FORMAT = "dflash-export"
# 2: the `shared` weight table; 1: shared weights found by parsing target.onnx. The version
# changes when a reader of the previous one would misread an export. A field whose absence
# means what exports did before it (attention "standard", no quantization, no hybrid layers,
# full draft vocabulary, no engines) is added without a change: older manifests load with
# that default, and a reader refuses a field it does not know (manifest.load_manifest: upgrade).
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
RUNTIME = "runtime.json"  # measured runtime choices (runtime/settings.py): allowed, never hashed
SHARED_DATA = "shared.data"

TARGET = "target"
DRAFT_CONTEXT = "draft_context"
DRAFT_BLOCK = "draft_block"

SHARED_INITIALIZERS = ("embed_tokens.weight", "lm_head.weight")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",  # where transformers 5 saves a chat template (gpt-oss's harmony template ships so)
)

# -- dim roles ---------------------------------------------------------------------------
# dynamic: sized per call (value: the smallest size a graph must take)
BATCH, SEQ, PAST, CTX, PAST_CTX, PICKS = "batch", "seq", "past", "ctx", "past_ctx", "picks"
WINDOW_PAST = "window_past"  # a sliding target layer's ring slots bound (<= the ring)
SCORED = "scored"  # the draft positions draft_block's head scores (Manifest.draft_index: 1..K-1)
DYNAMIC = {BATCH: 1, SEQ: 1, PAST: 0, CTX: 1, PAST_CTX: 0, PICKS: 1, WINDOW_PAST: 0, SCORED: 1}
# static: fixed by the manifest (`sizes`)
BLOCK, DRAFTS, VOCAB, TAPS_WIDTH, MAX_CTX = "block", "drafts", "vocab", "taps_width", "max_context"
DRAFT_VOCAB = "draft_vocab"  # the tokens draft_block scores: the vocabulary, or N (export --draft-vocab)
TOP_K = "selector_top_k"  # DFlash 2: candidates per draft position (Manifest.selector["top_k"])
KV_HEADS, HEAD_DIM, DRAFT_KV_HEADS, DRAFT_HEAD_DIM = "kv_heads", "head_dim", "draft_kv_heads", "draft_head_dim"
# static, sliding-window targets only: the sliding layers' K/V shape (manifest.windowed)
WINDOW_KV_HEADS, WINDOW_HEAD_DIM = "window_kv_heads", "window_head_dim"
# static, hybrid targets only: the Gated DeltaNet dims (manifest.linear)
CONV_WINDOW, CONV_DIM, K_HEADS, V_HEADS, K_DIM, V_DIM = "conv_window", "conv_dim", "k_heads", "v_heads", "k_dim", "v_dim"

# layer kinds (a hybrid or sliding-window target's `target_layer_types`; every other layer is
# attention); a KV-sharing layer is SHARED whatever its type (no cache tensors)
ATTENTION, LINEAR, SLIDING, SHARED = "full_attention", "linear_attention", "sliding_attention", "shared_kv"

# dtypes: numpy names, plus MODEL = the export's float dtype (manifest.dtype) and CACHE = the ort
# flavour's cache dtype (Manifest.kv_cache's, else MODEL's)
INT64, INT32, FLOAT32, MODEL, CACHE = "int64", "int32", "float32", "model", "cache"
NUMPY_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

# -- tensor names --------------------------------------------------------------------------
INPUT_IDS, POSITION_IDS, LOGITS, NEXT_IDS, TAPS = "input_ids", "position_ids", "logits", "next_ids", "taps"
CTX_POSITION_IDS = "ctx_position_ids"
BLOCK_IDS, BLOCK_POSITION_IDS, DRAFT_IDS, DRAFT_LOGITS = "block_ids", "block_position_ids", "draft_ids", "draft_logits"
DRAFT_CONF = "draft_conf"  # top-1 probability per draft: what adaptive verify reads
DRAFT_INDEX = "draft_index"  # the draft positions (0..K-2) the head scores (Manifest.draft_index)
# DFlash 2 drafters (Manifest.selector): per draft position the selector's top-k candidate ids and
# the walk's scores [prev, cand] (row p: after the p-th candidate of the position before; position 0:
# after the anchor, every row); draft_ids is then the greedy walk over them (docs/dflash2.md)
DRAFT_CANDIDATES, DRAFT_SCORES = "draft_candidates", "draft_scores"
SEQLENS_K, TOTAL_LEN = "seqlens_k", "total_sequence_length"  # ort flavour: past + seq - 1, past + seq
POSITIONS = (POSITION_IDS, CTX_POSITION_IDS, BLOCK_POSITION_IDS)  # each graph's position input
# ragged batches: valid target / drafter-context cache positions per row, and the target
# positions whose logits are computed (per row, indices into the call's S positions)
PAST_LENGTHS, CTX_LENGTHS, LOGITS_INDEX = "past_lengths", "ctx_lengths", "logits_index"


@dataclass(frozen=True)
class Tensor:
    """One graph input or output: `name` (a `{i}` template when `per_layer`), dim roles, dtype;
    a per-layer template exists for layers of its `kind` only."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    per_layer: bool = False
    kind: str = ATTENTION

    def at(self, i: int) -> "Tensor":
        return Tensor(self.name.format(i=i), self.dims, self.dtype)


@dataclass(frozen=True)
class Graph:
    file: str
    layers: str  # the manifest field counting its per-layer tensors
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]


def _kv(prefix: str, dims: tuple[str, ...]) -> tuple[Tensor, Tensor]:
    return Tensor(f"{prefix}_key.{{i}}", dims, MODEL, True), Tensor(f"{prefix}_value.{{i}}", dims, MODEL, True)


_TKV, _DKV = (KV_HEADS, HEAD_DIM), (DRAFT_KV_HEADS, DRAFT_HEAD_DIM)
PAST_KV = _kv("past", (BATCH, PAST, *_TKV))  # the target cache's valid prefix
NEW_KV = _kv("new", (BATCH, SEQ, *_TKV))  # only the new positions
CTX_KV = _kv("ctx", (BATCH, CTX, *_DKV))  # drafter context K/V to append
PAST_CTX_KV = _kv("past_ctx", (BATCH, PAST_CTX, *_DKV))  # the drafter context cache's valid prefix
# a linear-attention layer's committed state, and what a call returns to commit (runtime/hybrid.py)
LINEAR_STATE = (
    Tensor("conv_state.{i}", (BATCH, CONV_WINDOW, CONV_DIM), MODEL, True, LINEAR),
    Tensor("rec_state.{i}", (BATCH, V_HEADS, K_DIM, V_DIM), FLOAT32, True, LINEAR),
)
LINEAR_NEW = (
    Tensor("new_conv.{i}", (BATCH, SEQ, CONV_DIM), MODEL, True, LINEAR),
    Tensor("delta_k.{i}", (BATCH, SEQ, K_HEADS, K_DIM), MODEL, True, LINEAR),
    Tensor("delta_u.{i}", (BATCH, SEQ, V_HEADS, V_DIM), FLOAT32, True, LINEAR),
    Tensor("delta_g.{i}", (BATCH, SEQ, V_HEADS), FLOAT32, True, LINEAR),
)
# a sliding layer's ring (batch-major: every row has the same slots) and its new positions
WINDOW_KV = tuple(Tensor(t.name, t.dims, t.dtype, True, SLIDING)
                  for t in _kv("past", (BATCH, WINDOW_PAST, WINDOW_KV_HEADS, WINDOW_HEAD_DIM)))
WINDOW_NEW = tuple(Tensor(t.name, t.dims, t.dtype, True, SLIDING)
                   for t in _kv("new", (BATCH, SEQ, WINDOW_KV_HEADS, WINDOW_HEAD_DIM)))
def _cache(prefix: str) -> tuple[Tensor, Tensor]:
    return tuple(Tensor(t.name, t.dims, CACHE, True) for t in _kv(prefix, (BATCH, KV_HEADS, MAX_CTX, HEAD_DIM)))


CACHE_KV = _cache("past")  # ort flavour: the whole head-major buffer
PRESENT_KV = _cache("present")  # ... bound to the same memory as past
ATTENTION_FLAVOURS = ("standard", "ort")  # Manifest.attention, export --attention

GRAPHS: dict[str, Graph] = {
    TARGET: Graph(
        "target.onnx", "target_layers",
        inputs=(
            Tensor(INPUT_IDS, (BATCH, SEQ), INT64),
            Tensor(POSITION_IDS, (BATCH, SEQ), INT64),
            *PAST_KV,
            *LINEAR_STATE,
            *WINDOW_KV,
        ),
        outputs=(
            Tensor(LOGITS, (BATCH, SEQ, VOCAB), FLOAT32),
            Tensor(NEXT_IDS, (BATCH, SEQ), INT64),  # in-graph argmax
            Tensor(TAPS, (BATCH, SEQ, TAPS_WIDTH), MODEL),  # decoder layer outputs, target_layer_ids order
            *NEW_KV,
            *LINEAR_NEW,
            *WINDOW_NEW,
        ),
    ),
    DRAFT_CONTEXT: Graph(
        "draft_context.onnx", "draft_layers",
        inputs=(Tensor(TAPS, (BATCH, CTX, TAPS_WIDTH), MODEL), Tensor(CTX_POSITION_IDS, (BATCH, CTX), INT64)),
        outputs=CTX_KV,
    ),
    DRAFT_BLOCK: Graph(
        "draft_block.onnx", "draft_layers",
        inputs=(
            Tensor(BLOCK_IDS, (BATCH, BLOCK), INT64),  # [anchor, mask, ..., mask]
            Tensor(BLOCK_POSITION_IDS, (BATCH, BLOCK), INT64),
            *PAST_CTX_KV,
        ),
        outputs=(Tensor(DRAFT_IDS, (BATCH, DRAFTS), INT64),
                 Tensor(DRAFT_LOGITS, (BATCH, DRAFTS, DRAFT_VOCAB), FLOAT32),
                 Tensor(DRAFT_CONF, (BATCH, DRAFTS), FLOAT32)),
    ),
}
TARGET_ORT = Graph(
    "target.onnx", "target_layers",
    inputs=(
        Tensor(INPUT_IDS, (BATCH, SEQ), INT64),
        Tensor(POSITION_IDS, (BATCH, SEQ), INT64),
        Tensor(SEQLENS_K, (BATCH,), INT32),
        Tensor(TOTAL_LEN, (), INT32),
        *CACHE_KV,
    ),
    outputs=(
        Tensor(LOGITS, (BATCH, SEQ, VOCAB), FLOAT32),
        Tensor(NEXT_IDS, (BATCH, SEQ), INT64),
        Tensor(TAPS, (BATCH, SEQ, TAPS_WIDTH), MODEL),
        *PRESENT_KV,
    ),
)

# -- ragged batches (Manifest.ragged): the same graphs with per-row lengths and logits picks --
PAST_KV_ROWS = _kv("past", (PAST, BATCH, *_TKV))  # position-major: all rows' prefix is one view
PAST_CTX_KV_ROWS = _kv("past_ctx", (PAST_CTX, BATCH, *_DKV))
_ROWS_IN = (
    Tensor(BLOCK_IDS, (BATCH, BLOCK), INT64),
    Tensor(BLOCK_POSITION_IDS, (BATCH, BLOCK), INT64),
    Tensor(CTX_LENGTHS, (BATCH,), INT64),  # valid context positions of each row (== its anchor's position)
)
# exports before Manifest.draft_index: the head scores every draft position
DRAFT_BLOCK_ALL = Graph("draft_block.onnx", "draft_layers", (*_ROWS_IN, *PAST_CTX_KV_ROWS), GRAPHS[DRAFT_BLOCK].outputs)
_PICKED = (Tensor(LOGITS, (BATCH, PICKS, VOCAB), FLOAT32), Tensor(NEXT_IDS, (BATCH, PICKS), INT64))
RAGGED: dict[str, Graph] = {
    TARGET: Graph(
        "target.onnx", "target_layers",
        inputs=(
            Tensor(INPUT_IDS, (BATCH, SEQ), INT64),  # a row shorter than S is padded at its end
            Tensor(POSITION_IDS, (BATCH, SEQ), INT64),
            Tensor(PAST_LENGTHS, (BATCH,), INT64),  # valid past positions of each row (<= P)
            Tensor(LOGITS_INDEX, (BATCH, PICKS), INT64),  # positions (0..S-1) whose logits are computed
            *PAST_KV_ROWS,
            *LINEAR_STATE,
            *WINDOW_KV,
        ),
        outputs=(*_PICKED, *GRAPHS[TARGET].outputs[2:]),
    ),
    DRAFT_CONTEXT: GRAPHS[DRAFT_CONTEXT],  # per position: a row's padding is computed and not kept
    DRAFT_BLOCK: Graph(
        "draft_block.onnx", "draft_layers",
        inputs=(*_ROWS_IN,
                Tensor(DRAFT_INDEX, (SCORED,), INT64),  # the loop's 0..n-1: n + 1 its longest verify this round
                *PAST_CTX_KV_ROWS),
        outputs=(Tensor(DRAFT_IDS, (BATCH, SCORED), INT64),
                 Tensor(DRAFT_LOGITS, (BATCH, SCORED, DRAFT_VOCAB), FLOAT32),
                 Tensor(DRAFT_CONF, (BATCH, SCORED), FLOAT32)),
    ),
}
TARGET_ORT_RAGGED = Graph(  # GroupQueryAttention takes per-row lengths already (seqlens_k)
    "target.onnx", "target_layers",
    inputs=(*TARGET_ORT.inputs[:4], Tensor(LOGITS_INDEX, (BATCH, PICKS), INT64), *CACHE_KV),
    outputs=(*_PICKED, *TARGET_ORT.outputs[2:]),
)
SELECTOR_OUTPUTS = (Tensor(DRAFT_CANDIDATES, (BATCH, DRAFTS, TOP_K), INT64),
                    Tensor(DRAFT_SCORES, (BATCH, DRAFTS, TOP_K, TOP_K), FLOAT32))
GRAPH_FILES = {g: spec.file for g, spec in GRAPHS.items()}
ID_LOGITS = {NEXT_IDS: LOGITS, DRAFT_IDS: DRAFT_LOGITS}  # each in-graph argmax and the logits it reads


def _expand(tensors: tuple[Tensor, ...], kinds: list[str]) -> list[Tensor]:
    """Templates in order: a run of per-layer tensors repeats per layer with the templates of
    that layer's kind, as k0 v0 k1 v1 ... (hybrid: k0 v0 conv1 rec1 ...)."""
    out, group = [], []
    for t in (*tensors, None):
        if t is not None and t.per_layer:
            group.append(t)
            continue
        out += [g.at(i) for i, kind in enumerate(kinds) for g in group if g.kind == kind]
        group = []
        if t is not None:
            out.append(t)
    return out


def layer_kinds(graph: str, m) -> list[str]:
    """The kind of each layer whose tensors `graph` carries: ATTENTION, a hybrid target's LINEAR,
    a sliding-window target's SLIDING and SHARED (KV-sharing: none)."""
    g = GRAPHS[graph]
    types = getattr(m, "target_layer_types", None) if g.layers == "target_layers" else None
    if not types:
        return [ATTENTION] * getattr(m, g.layers)
    source = (window(m) or {}).get("kv_source") or list(range(len(types)))
    return [SHARED if source[i] != i else t if t in (LINEAR, SLIDING) else ATTENTION for i, t in enumerate(types)]


def window(m) -> dict | None:
    """A sliding-window target's record (Manifest.windowed: family, window, ring, the sliding
    layers' kv_heads / head_dim, kv_source, ...); None for every other target."""
    return getattr(m, "windowed", None)


def flavour(m) -> str:
    """The manifest's attention flavour ("standard" for manifests written before flavours)."""
    return getattr(m, "attention", "standard")


def ragged(m) -> bool:
    """Whether the export's graphs take ragged batches (False for exports made before them)."""
    return bool(getattr(m, "ragged", False))


def selector(m) -> dict | None:
    """A DFlash 2 export's candidate selector record ({"top_k", "rank", ...}); None: DFlash 1."""
    return getattr(m, "selector", None)


def row_counts(m) -> bool:
    """Whether the ort flavour's target takes each row's own count of new tokens (Manifest.row_counts):
    the runtime feeds seqlens_k = length + count - 1 per row and the graph gives GroupQueryAttention
    query_seqlens = seqlens_k + 1 - position_ids[:, 0] (rows right-padded to the call's length)."""
    return bool(getattr(m, "row_counts", False))


def draft_index(m) -> bool:
    """Whether draft_block takes `draft_index` (its head scores the drafts a verify uses); False
    for exports made before it, and for DFlash 2 drafters (their selector walks every position)."""
    return bool(getattr(m, "draft_index", False))


def ring(m) -> int | None:
    """Slots of the drafter's context ring (Manifest.draft_ring); None: one slot per position."""
    return getattr(m, "draft_ring", None)


def spec(graph: str, m) -> Graph:
    """The declared graph for this manifest's attention flavour, batching and drafter family."""
    r = ragged(m)
    if graph == TARGET and flavour(m) == "ort":
        return TARGET_ORT_RAGGED if r else TARGET_ORT
    g = (RAGGED if r else GRAPHS)[graph]
    if graph == DRAFT_BLOCK and r and not draft_index(m):
        g = DRAFT_BLOCK_ALL
    if graph == DRAFT_BLOCK and selector(m):
        return Graph(g.file, g.layers, g.inputs, g.outputs + SELECTOR_OUTPUTS)
    return g


def io(graph: str, m) -> tuple[list[Tensor], list[Tensor]]:
    """(inputs, outputs) of `graph` for the manifest `m` (anything with its layer counts)."""
    g = spec(graph, m)
    kinds = layer_kinds(graph, m)
    return _expand(g.inputs, kinds), _expand(g.outputs, kinds)


def names(graph: str, m) -> tuple[list[str], list[str]]:
    ins, outs = io(graph, m)
    return [t.name for t in ins], [t.name for t in outs]


def tensor(graph: str, name: str, m) -> Tensor:
    """The input or output of `graph` called `name` (a concrete name such as past_key.3)."""
    ins, outs = io(graph, m)
    for t in (*ins, *outs):
        if t.name == name:
            return t
    raise DFlashError(f"{graph} has no tensor {name!r}; re-export the directory")


def find(graph: str, name: str, m=None) -> Tensor:
    """The declared tensor (a template for per-layer ones) behind a concrete name (without a
    manifest: the batch-1 graphs' first, then the ragged ones'; with one, the template of that
    layer's kind)."""
    kinds = layer_kinds(graph, m) if m is not None else None
    every = (GRAPHS[graph], RAGGED[graph], *((DRAFT_BLOCK_ALL,) if graph == DRAFT_BLOCK else ()))
    for g in every if m is None else (spec(graph, m),):
        for t in (*g.inputs, *g.outputs, *(SELECTOR_OUTPUTS if graph == DRAFT_BLOCK and m is None else ())):
            prefix = t.name.split("{")[0]
            if name == t.name:
                return t
            if t.per_layer and name.startswith(prefix) and name[len(prefix):].isdigit():
                i = int(name[len(prefix):])
                if kinds is None or (i < len(kinds) and kinds[i] == t.kind):
                    return t
    raise DFlashError(f"{graph} has no tensor {name!r}; re-export the directory")


def role(graph: str, name: str, axis: int, m=None) -> str:
    """The role of one axis of a graph tensor (e.g. role("target", "past_key.3", 1) == PAST);
    dynamic when it is a key of DYNAMIC, else a static role that `sizes` gives."""
    return find(graph, name, m).dims[axis]


def sizes(m) -> dict[str, int]:
    """The static dim roles' sizes for a manifest (or anything with the same fields)."""
    return {
        BLOCK: m.block_size, DRAFTS: m.block_size - 1, VOCAB: m.vocab_size, DRAFT_VOCAB: draft_vocab_size(m),
        TAPS_WIDTH: len(m.target_layer_ids) * m.hidden_size,
        KV_HEADS: m.target_kv_heads, HEAD_DIM: m.target_head_dim,
        DRAFT_KV_HEADS: m.draft_kv_heads, DRAFT_HEAD_DIM: m.draft_head_dim,
        MAX_CTX: getattr(m, "max_context", None),  # the ort flavour's whole-buffer dim
        **({TOP_K: int(selector(m)["top_k"])} if selector(m) else {}),
        **linear_sizes(getattr(m, "linear", None)),
        **({WINDOW_KV_HEADS: window(m)["kv_heads"], WINDOW_HEAD_DIM: window(m)["head_dim"]} if window(m) else {}),
    }


def max_seq(m) -> int | None:
    """Most positions one target call takes, when the graph caps it (hybrid: one delta-rule chunk)."""
    linear = getattr(m, "linear", None)
    return int(linear["max_seq"]) if linear else None


def linear_sizes(linear: dict | None) -> dict[str, int]:
    """The Gated DeltaNet roles' sizes from a manifest's `linear` record (hybrid targets)."""
    if not linear:
        return {}
    return {CONV_WINDOW: linear["conv_kernel"] - 1, CONV_DIM: linear["conv_dim"], K_HEADS: linear["k_heads"],
            V_HEADS: linear["v_heads"], K_DIM: linear["k_dim"], V_DIM: linear["v_dim"]}
def draft_vocab_size(m) -> int:
    """How many tokens draft_block scores: N of a reduced draft vocabulary, else the vocabulary."""
    dv = getattr(m, "draft_vocab", None)
    return int(dv["size"]) if dv else m.vocab_size


def shape(t: Tensor, m, **dynamic: int) -> tuple[int, ...]:
    """Concrete shape of `t`: static roles from the manifest, dynamic ones from keywords."""
    static = sizes(m)
    return tuple(dynamic[r] if r in DYNAMIC else static[r] for r in t.dims)


def kv_cache(m) -> dict | None:
    """The ort flavour's quantized cache record (Manifest.kv_cache: {"dtype": "int8", "scales":
    "per-channel", ...}); None: the cache is in the model dtype."""
    return getattr(m, "kv_cache", None)


def dtype(t: Tensor, m) -> str:
    """numpy dtype name of `t` in an export of dtype m.dtype ("fp32" | "fp16" | "bf16")."""
    if t.dtype == CACHE and kv_cache(m):
        return kv_cache(m)["dtype"]
    return NUMPY_DTYPE[m.dtype] if t.dtype in (MODEL, CACHE) else t.dtype
