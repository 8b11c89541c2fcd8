"""The MoE block in the target graph, two ways, chosen at export (`export --moe`) and recorded
in the manifest's `moe` record:

- "op": ONNX Runtime's com.microsoft::MoE, one node per layer that routes and runs only the
  selected experts (CPU kernel since onnxruntime 1.23.1, float32). Its CPU kernel reads SwiGLU
  experts in one layout only: `fc1 [E, 2I, H]` with gate and up rows interleaved
  (`swiglu_fusion=1`; 0 and 2 are refused on CPU), `fc2 [E, H, I]`, no FC3. It takes the raw
  router logits (it applies the softmax and top-k itself) and `normalize_routing_weights` =
  `norm_topk_prob`. It has no shared-expert input: the shared expert and its sigmoid gate are
  computed beside the node in standard ops. tests/test_moe.py checks these semantics against
  transformers' own Qwen3-MoE and Qwen3.5-MoE blocks on a one-node graph.
- "standard": standard ai.onnx ops for TensorRT, other execution providers and older ONNX
  Runtime: Softmax + TopK route, Gather takes the k selected experts' weights per token
  ([T, k, 2I, H] and [T, k, H, I]) and two batched MatMuls apply them. It reads k experts per
  token, so a T-token call gathers k*T expert matrices (shared ones again): fine for steps and
  verify blocks, heavy for long prefill chunks at real widths.

The PyTorch reference (models/moe.py) runs transformers' loop over the selected experts;
`check` holds either graph to it.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from onnxscript import values

from ..runtime.errors import DFlashError, InternalError
from ..runtime.lazy import lazy_import
from ..models import moe as M
from ..models.config import MoeConfig
from .ops import register_ort_schemas

ort = lazy_import("onnxruntime")
ort_state = lazy_import("onnxruntime.capi._pybind_state")  # ORT's own int4 / int8 block quantizers
helper = lazy_import("onnx.helper")
numpy_helper = lazy_import("onnx.numpy_helper")

PATHS = ("op", "standard")
OP = ("com.microsoft", "MoE")  # what an "op" export's target graph holds beyond ai.onnx
MIN_ORT = (1, 23, 1)  # the first onnxruntime with a CPU kernel for com.microsoft::MoE


def ort_has_op() -> bool:
    """Whether the installed onnxruntime runs com.microsoft::MoE on CPU (>= 1.23.1)."""
    try:
        parts = tuple(int(p) for p in ort.__version__.split("+")[0].split(".")[:3])
    except (ImportError, ValueError):
        return False
    return parts >= MIN_ORT


def choose_path(requested: str | None, dtype: str, activation: str = "swiglu") -> str:
    """`export --moe`: the requested path, or the default: the contrib op where ONNX Runtime
    runs it here (fp32, onnxruntime >= 1.23.1, SwiGLU experts), else standard ops. One line when refused."""
    if requested is None:
        return "op" if dtype == "fp32" and ort_has_op() and activation == "swiglu" else "standard"
    if requested not in PATHS:
        raise DFlashError(f"--moe must be one of {', '.join(PATHS)} (got {requested!r})")
    if requested == "op" and activation != "swiglu":
        raise DFlashError(f"--moe op: ONNX Runtime's CPU MoE kernel runs SwiGLU experts only, and these are "
                          f"{activation.upper()} (Gemma 4); export with --moe standard")
    if requested == "op" and dtype != "fp32":
        raise DFlashError(f"--moe op with --dtype {dtype}: ONNX Runtime's MoE op runs on CPU in float32 only; "
                          "export with --dtype fp32, or with --moe standard for half precision")
    if requested == "op" and not ort_has_op():
        raise DFlashError(f"--moe op needs onnxruntime >= {'.'.join(map(str, MIN_ORT))} (found {ort.__version__}), "
                          "the first with a CPU kernel for com.microsoft::MoE; upgrade it or export with --moe standard")
    return requested


def record(tc, path: str) -> dict:
    """The manifest's `moe` record: the graph form and the routing the runtime's cost model reads."""
    m = tc.moe
    return dict(path=path, experts=m.num_experts, top_k=m.top_k, expert_size=m.expert_size,
                shared_expert_size=m.shared_expert_size, norm_topk_prob=m.norm_topk_prob,
                layers=list(m.sparse_layers), activation=m.activation)


def use_path(target, path: str) -> None:
    """Install the graph form `path` on every MoE block of `target` (before tracing).

    "op" stores each gate_up_proj interleaved (g0, u0, g1, u1, ... rows), in place, one layer
    at a time: the layout the CPU kernel reads, written once into the graph's weights (gpt-oss's
    are so already; its biases likewise). A block's `fold` (Gemma 4's per-expert scale) goes
    into its down projection first."""
    for block in M.blocks(target):
        if hasattr(block, "fold"):
            block.fold()
        if path == "op":
            ex = block.experts
            if not ex.interleaved:
                ex.gate_up_proj.data = interleave(ex.gate_up_proj.data)
                if ex.biased:
                    ex.gate_up_proj_bias.data = interleave(ex.gate_up_proj_bias.data[..., None])[..., 0]
                ex.interleaved = True
            block.graph_experts = contrib_experts
        else:
            block.graph_experts = gathered_experts


def interleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] as [gate; up] rows -> gate and up rows alternating (swiglu_fusion=1)."""
    e, two_i, h = gate_up.shape
    return gate_up.view(e, 2, two_i // 2, h).transpose(1, 2).reshape(e, two_i, h).contiguous()


# -- "standard": gathered experts in ai.onnx ops -------------------------------------------


def gathered_experts(block, t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """tokens [T, H], router logits [T, E] -> the routed experts' weighted sum [T, H]:
    TopK, Gather of each token's k experts, two batched MatMuls, a weighted ReduceSum."""
    weights, ids = M.route(logits, block.top_k, block.norm_topk_prob)
    ex = block.experts
    h = torch.matmul(ex.gate_up_proj[ids], t[:, None, :, None])[..., 0]  # T k 2I
    if ex.biased:
        h = h + ex.gate_up_proj_bias[ids]
    y = torch.matmul(ex.down_proj[ids], ex.swiglu(h)[..., None])[..., 0]  # T k H
    if ex.biased:
        y = y + ex.down_proj_bias[ids]
    return (y * weights[..., None]).sum(dim=1)


# -- "op": com.microsoft::MoE ----------------------------------------------------------------


NO_LIMIT = float("inf")  # swiglu_limit when the experts' activation is not clamped (the attribute is left out)


@torch.library.custom_op("dflash::moe", mutates_args=())
def moe_op(x: torch.Tensor, logits: torch.Tensor, fc1: torch.Tensor, fc1_bias: torch.Tensor | None, fc2: torch.Tensor,
           fc2_bias: torch.Tensor | None, k: int, normalize: bool, alpha: float, beta: float,
           limit: float) -> torch.Tensor:
    """com.microsoft::MoE's semantics in torch: x [T, H], raw router logits [T, E], fc1
    [E, 2I, H] interleaved (+ bias [E, 2I]), fc2 [E, H, I] (+ bias [E, H]) -> [T, H] (softmax,
    top-k, optional renorm, SwiGLU with its alpha, beta and clamp)."""
    weights, ids = M.route(logits, k, normalize)
    moe = MoeConfig(fc1.shape[0], k, fc1.shape[1] // 2, normalize, alpha=alpha, beta=beta,
                    limit=None if limit == NO_LIMIT else limit, bias=fc1_bias is not None)
    ex = M.Experts(fc1.shape[0], fc1.shape[2], fc1.shape[1] // 2, moe)
    ex.gate_up_proj, ex.down_proj, ex.interleaved = torch.nn.Parameter(fc1), torch.nn.Parameter(fc2), True
    if fc1_bias is not None:
        ex.gate_up_proj_bias, ex.down_proj_bias = torch.nn.Parameter(fc1_bias), torch.nn.Parameter(fc2_bias)
    with torch.no_grad():
        return ex(x, ids, weights)


@moe_op.register_fake
def _(x, logits, fc1, fc1_bias, fc2, fc2_bias, k, normalize, alpha, beta, limit):
    return x.new_empty(x.shape)


def contrib_experts(block, t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    ex = block.experts
    b1, b2 = (ex.gate_up_proj_bias, ex.down_proj_bias) if ex.biased else (None, None)
    return moe_op(t, logits, ex.gate_up_proj, b1, ex.down_proj, b2, block.top_k, block.norm_topk_prob, ex.alpha, ex.beta,
                  NO_LIMIT if ex.limit is None else ex.limit)


register_ort_schemas()
_msft = values.Opset("com.microsoft", 1)


def _moe_onnx(x, logits, fc1, fc1_bias, fc2, fc2_bias, k: int, normalize: bool, alpha: float, beta: float,
              limit: float):
    clamp = {} if limit == NO_LIMIT else {"swiglu_limit": limit}
    return _msft.MoE(x, logits, fc1, fc1_bias, fc2, fc2_bias, k=k, activation_type="swiglu", swiglu_fusion=1,
                     normalize_routing_weights=int(normalize), activation_alpha=alpha, activation_beta=beta, **clamp)


TRANSLATION = {torch.ops.dflash.moe.default: _moe_onnx}


# -- quantize: the op path's experts as com.microsoft::QMoE ----------------------------------

def quantize_experts(w: np.ndarray, bits: int, block: int, symmetric: bool):
    """Expert weights [E, N, K] (x @ W[e].T) -> (codes uint8 [E, N, K*bits/8], scales [E, N, K/block],
    zero points uint8 [E, N, ceil(K/block*bits/8)] or None when symmetric), round-to-nearest along K.

    ONNX Runtime's own kernels (quantize_matmul_{4,8}bits, MatMulNBitsQuantizer's) do the rounding,
    expert by expert: their [N, blocks, blob] output is QMoE's raw layout (weights_prepacked=0)."""
    fn = {4: ort_state.quantize_matmul_4bits, 8: ort_state.quantize_matmul_8bits}[bits]
    e, n, k = w.shape
    blocks = k // block
    codes = np.zeros((e, n, blocks, block * bits // 8), np.uint8)
    zp = np.zeros((e, n, (blocks * bits + 7) // 8), np.uint8)
    scales = np.zeros((e, n, blocks), w.dtype)
    for i in range(e):
        fn(codes[i], np.ascontiguousarray(w[i].T), scales[i], zp[i], block, n, k, symmetric)
    return codes.reshape(e, n, k * bits // 8), scales, None if symmetric else zp


def to_qmoe(proto, bits: int, block: int, symmetric: bool) -> list[str]:
    """Replace every com.microsoft::MoE node of an onnx ModelProto (weights loaded) by a
    com.microsoft::QMoE over the same experts quantized block-wise; returns the float
    weights' names. Expert widths must divide into blocks (QMoE's rule): one line if not. The
    accuracy level is set afterwards with MatMulNBits' (export/accuracy_level.py set_level)."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    done = []
    for node in [n for n in graph.node if n.domain == OP[0] and n.op_type == OP[1]]:
        fc1, fc2 = node.input[2], node.input[4]
        w1, w2 = numpy_helper.to_array(inits[fc1]), numpy_helper.to_array(inits[fc2])
        h, i = w1.shape[2], w2.shape[2]
        if h % block or i % block:
            raise DFlashError(f"--quant-block-size {block} does not divide the experts' hidden size {h} and width {i}, "
                              "as ONNX Runtime's QMoE requires; choose a block size dividing both")
        ins = {}
        for name, w in ((fc1, w1), (fc2, w2)):
            codes, scales, zp = quantize_experts(w, bits, block, symmetric)
            ins[name] = [f"{name}_Q{bits}", f"{name}_scales", f"{name}_zp{bits}" if zp is not None else ""]
            graph.initializer.extend(numpy_helper.from_array(a, n) for a, n in zip((codes, scales, zp), ins[name]) if n)
        attrs = attrs_of(node)
        attrs.update(expert_weight_bits=bits, block_size=block, weights_prepacked=0, normalize_routing_weights=1)
        (q1, s1, z1), (q2, s2, z2) = ins[fc1], ins[fc2]
        out = node.output[0]
        renorm = [] if attrs_of(node).get("normalize_routing_weights") else unnormalise(node, out, attrs["k"])
        bias = list(node.input[3:6:2]) + [""] * 2  # fc1/fc2 expert biases (gpt-oss) stay float
        q = helper.make_node("QMoE", [node.input[0], node.input[1], q1, s1, bias[0], q2, s2, bias[1], "", "", "", z1, z2],
                             [f"{out}_renormalised" if renorm else out], name=node.name, domain=OP[0], **attrs)
        at = list(graph.node).index(node)
        node.CopyFrom(q)
        while node.input and not node.input[-1]:
            node.input.pop()
        for j, extra in enumerate(renorm):
            graph.node.insert(at + 1 + j, extra)
        done += [fc1, fc2]
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used or t.name not in done]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return done


def attrs_of(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def unnormalise(node, out: str, k: int) -> list:
    """Nodes that scale QMoE's output back to un-renormalised routing weights (norm_topk_prob
    false): QMoE's CPU kernel (onnxruntime 1.32) renormalises the top-k weights whatever
    normalize_routing_weights says, so the graph asks for renormalised weights explicitly and
    multiplies by their sum before renormalising, softmax(logits).topk(k).sum() (standard ops)."""
    p = f"{out}_route"
    consts = [numpy_helper.from_array(np.array([k], np.int64), f"{p}_k"),
              numpy_helper.from_array(np.array([-1], np.int64), f"{p}_axes")]
    return [helper.make_node("Constant", [], [f"{p}_k"], value=consts[0]),
            helper.make_node("Constant", [], [f"{p}_axes"], value=consts[1]),
            helper.make_node("Softmax", [node.input[1]], [f"{p}_probs"], axis=-1),
            helper.make_node("TopK", [f"{p}_probs", f"{p}_k"], [f"{p}_top", f"{p}_ids"], axis=-1),
            helper.make_node("ReduceSum", [f"{p}_top", f"{p}_axes"], [f"{p}_sum"], keepdims=1),
            helper.make_node("Mul", [f"{out}_renormalised", f"{p}_sum"], [out])]


# -- quantize: the standard path's experts, dequantized after the gather ------------------------

EXPERTS = re.compile(r"(?:^|\.)experts\.(gate_up_proj|down_proj)$")  # a routed expert tensor [E, N, K]
GATHERS = {"Gather": ("axis", 0), "GatherND": ("batch_dims", 0)}  # how a traced graph reads k experts per token


def to_gathered(proto, bits: int, block: int, symmetric: bool) -> list[str]:
    """--moe standard: every expert tensor [E, N, K] the target graph gathers -> the codes, scales
    and zero points QMoE holds (`quantize_experts`: the same names and layout, so export/stream.py
    `put_back` writes either form), gathered per token like the float tensor was and dequantized
    right after the gather in standard ops (`dequantize_nodes`): only the k experts a token
    selected are ever in float. Returns the float tensors' names.

    Cast + Sub + Mul rather than DequantizeLinear's blocked form: that needs opset 21 (the export
    writes 20), which older ONNX Runtime releases and other providers, this form's users, may
    not run, and on ONNX Runtime's CPU it was only 5-13 % faster (docs/moe.md, "Quantization")."""
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    users: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            users.setdefault(i, []).append(node)
    done, dropped = [], []
    for name in [n for n, t in inits.items() if EXPERTS.search(n) and len(t.dims) == 3]:
        w = numpy_helper.to_array(inits[name])
        k = w.shape[2]
        if k % block:
            raise DFlashError(f"--quant-block-size {block} does not divide the input width {k} of the experts {name}; "
                              "choose a block size dividing the hidden size and the expert width")
        parts = [f"{name}_Q{bits}", f"{name}_scales", f"{name}_zp{bits}"]
        codes, scales, zp = quantize_experts(w, bits, block, symmetric)
        graph.initializer.extend(numpy_helper.from_array(a, n) for a, n in zip((codes, scales, zp), parts) if a is not None)
        gathers, transposes = _gathers(name, users)
        for gather in gathers:
            at = list(graph.node).index(gather)
            new = dequantize_nodes(gather, parts if zp is not None else parts[:2], bits, block, w.shape[1:], w.dtype)
            del graph.node[at]
            for j, n in enumerate(new):
                graph.node.insert(at + j, n)
        done.append(name)
        dropped += transposes
    for node in dropped:  # read by the gathers alone (`_gathers`), which read codes now
        graph.node.remove(node)
    keep = [t for t in graph.initializer if t.name not in done]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return done


def _gathers(name: str, users: dict) -> tuple[list, list]:
    """(the gathers that read expert tensor `name`, the identity Transposes a trace puts between).
    Anything else reading it is a graph this exporter did not write: an internal error."""
    found, between, todo = [], [], list(users.get(name, []))
    while todo:
        node = todo.pop()
        attrs = attrs_of(node)
        if node.op_type == "Transpose" and attrs.get("perm") == [0, 1, 2]:
            between.append(node)
            todo += users.get(node.output[0], [])
        elif node.op_type in GATHERS and attrs.get(GATHERS[node.op_type][0], 0) == GATHERS[node.op_type][1]:
            found.append(node)
        else:
            raise InternalError(f"expert tensor {name} is read by a {node.op_type} ({node.name}), not gathered per token")
    return found, between


def dequantize_nodes(gather, parts: list[str], bits: int, block: int, nk: tuple[int, int], dtype) -> list:
    """The gather of `parts` (codes [E, N, K*bits/8], scales [E, N, K/block], zero points or none)
    with `gather`'s indices, dequantized to the float [..., N, K] that `gather` gave: the codes
    unpacked (int4: low nibble first, BitwiseAnd / BitShift), Cast, minus the zero point
    (2^(bits-1) when symmetric), times the block's scale."""
    out, idx = gather.output[0], gather.input[1]
    (n, k), blocks, p = nk, nk[1] // block, f"{out}_dq"
    zb = (blocks * bits + 7) // 8
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    const = lambda n, v, dt=np.int64: _const(f"{p}_{n}", v, dt)  # noqa: E731
    take = lambda src, dst: helper.make_node(gather.op_type, [src, idx], [dst], **attrs_of(gather))  # noqa: E731
    nodes = [take(parts[0], f"{p}_codes"), take(parts[1], f"{p}_scales"),
             const("blocks", [-1, n, blocks, block * bits // 8]), const("width", [k]),
             helper.make_node("Shape", [f"{p}_codes"], [f"{p}_lead"], end=-1),  # the gathered dims and N
             helper.make_node("Reshape", [f"{p}_codes", f"{p}_blocks"], [f"{p}_packed"])]
    q = _unpacked(nodes, f"{p}_packed", bits, p, [-1, n, blocks, block])
    nodes += [helper.make_node("Cast", [q], [f"{p}_qf"], to=to)]
    if len(parts) == 3:  # asymmetric: each row's zero points, packed along the blocks
        nodes += [take(parts[2], f"{p}_zg"), const("zrows", [-1, n, zb]),
                  helper.make_node("Reshape", [f"{p}_zg", f"{p}_zrows"], [f"{p}_zpacked"])]
        z = _unpacked(nodes, f"{p}_zpacked", bits, f"{p}_z", [-1, n, zb * 8 // bits])
        nodes += [const("zstart", [0]), const("zend", [blocks]), const("zaxis", [2]), const("last", [-1]),
                  helper.make_node("Slice", [z, f"{p}_zstart", f"{p}_zend", f"{p}_zaxis"], [f"{p}_zu"]),
                  helper.make_node("Cast", [f"{p}_zu"], [f"{p}_zf"], to=to),
                  helper.make_node("Unsqueeze", [f"{p}_zf", f"{p}_last"], [f"{p}_zero"])]
    else:
        nodes += [const("zero", 2.0 ** (bits - 1), dtype)]
    nodes += [helper.make_node("Sub", [f"{p}_qf", f"{p}_zero"], [f"{p}_centred"]),
              const("srows", [-1, n, blocks, 1]),
              helper.make_node("Reshape", [f"{p}_scales", f"{p}_srows"], [f"{p}_s"]),
              helper.make_node("Mul", [f"{p}_centred", f"{p}_s"], [f"{p}_w"]),
              helper.make_node("Concat", [f"{p}_lead", f"{p}_width"], [f"{p}_full"], axis=0),
              helper.make_node("Reshape", [f"{p}_w", f"{p}_full"], [out], name=gather.name)]
    return nodes


def _unpacked(nodes: list, src: str, bits: int, p: str, shape: list[int]) -> str:
    """uint8 codes `src` -> the name of one value per element (int4: two a byte, low nibble first,
    reshaped to `shape`; int8: `src` itself), the nodes that make it appended to `nodes`."""
    if bits == 8:
        return src
    nodes += [_const(f"{p}_mask", 15, np.uint8), _const(f"{p}_four", 4, np.uint8), _const(f"{p}_pairs", [-1]),
              _const(f"{p}_shape", shape),
              helper.make_node("BitwiseAnd", [src, f"{p}_mask"], [f"{p}_lo"]),
              helper.make_node("BitShift", [src, f"{p}_four"], [f"{p}_hi"], direction="RIGHT"),
              helper.make_node("Unsqueeze", [f"{p}_lo", f"{p}_pairs"], [f"{p}_lo1"]),
              helper.make_node("Unsqueeze", [f"{p}_hi", f"{p}_pairs"], [f"{p}_hi1"]),
              helper.make_node("Concat", [f"{p}_lo1", f"{p}_hi1"], [f"{p}_both"], axis=-1),
              helper.make_node("Reshape", [f"{p}_both", f"{p}_shape"], [f"{p}_unpacked"])]
    return f"{p}_unpacked"


def _const(name: str, value, dtype=np.int64):
    """A Constant node whose output `name` is `value` as a `dtype` array."""
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype), name))


def gathered_parts(proto) -> list[tuple[str, str, str, str | None, int]]:
    """The quantized expert tensors of a --moe standard target (`to_gathered`): (float name, codes,
    scales, zero points or None, bits) for each codes initializer a gather reads (QMoE's are its inputs)."""
    names = {t.name for t in proto.graph.initializer}
    gathered = {n.input[0] for n in proto.graph.node if n.op_type in GATHERS}
    out = []
    for n in sorted(names & gathered):
        m = re.match(r"(.*)_Q(4|8)$", n)
        if m and EXPERTS.search(m.group(1)) and f"{m.group(1)}_scales" in names:
            bits = int(m.group(2))
            zp = f"{m.group(1)}_zp{bits}"
            out.append((m.group(1), n, f"{m.group(1)}_scales", zp if zp in names else None, bits))
    return out


def dequantize_experts(codes: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int) -> np.ndarray:
    """codes uint8 [E, N, K*bits/8], scales [E, N, blocks], zero points uint8 [E, N, ceil(blocks*bits/8)]
    or None (2^(bits-1)) -> float32 [E, N, K], per the contrib-op spec (4 bits: low nibble first).
    Written here, not taken from ONNX Runtime, so that `check` compares the graphs with an
    independent reading of their weights."""
    s = scales.astype(np.float32)
    e, n, blocks = s.shape
    q = np.stack([codes & 0x0F, codes >> 4], -1) if bits == 4 else codes
    q = q.reshape(e, n, blocks, -1)
    if zp is not None:
        z = (np.stack([zp & 0x0F, zp >> 4], -1).reshape(e, n, -1) if bits == 4 else zp)[..., :blocks]
    else:
        z = np.full((e, n, blocks), 2 ** (bits - 1), np.uint8)
    return ((q.astype(np.float32) - z[..., None].astype(np.float32)) * s[..., None]).reshape(e, n, -1)


def dequantize_qmoe(node, arrays: dict) -> dict[str, np.ndarray]:
    """A QMoE node's expert weights as the float [E, N, K] tensors the PyTorch source holds
    ({fc1 name: gate_up_proj, fc2 name: down_proj}), read from its packed inputs per the
    contrib-op spec (4 bits: low nibble first; no zero points: 2^(bits-1)); fc1's interleaved
    gate/up rows are put back as [gate; up]. Written here, not taken from ONNX Runtime, so
    that `check` compares the graph with an independent reading of its weights."""
    attr = attrs_of(node)
    bits = attr.get("expert_weight_bits", 4)
    ins = list(node.input) + [""] * 13
    out = {}
    for codes, scales, zp in ((ins[2], ins[3], ins[11]), (ins[5], ins[6], ins[12])):
        w = dequantize_experts(arrays[codes], arrays[scales], arrays[zp] if zp else None, bits)
        if codes == ins[2] and attr.get("swiglu_fusion") == 1:
            w = np.concatenate([w[:, 0::2], w[:, 1::2]], 1)
        out[codes.rsplit("_Q", 1)[0]] = w
    return out
