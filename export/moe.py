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

import numpy as np
import torch
from onnxscript import values

from ..errors import DFlashError
from ..lazy import lazy_import
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


def dequantize_qmoe(node, arrays: dict) -> dict[str, np.ndarray]:
    """A QMoE node's expert weights as the float [E, N, K] tensors the PyTorch source holds
    ({fc1 name: gate_up_proj, fc2 name: down_proj}), read from its packed inputs per the
    contrib-op spec (4 bits: low nibble first; no zero points: 2^(bits-1)); fc1's interleaved
    gate/up rows are put back as [gate; up]. Written here, not taken from ONNX Runtime, so
    that `check` compares the graph with an independent reading of its weights."""
    attr = attrs_of(node)
    bits, block = attr.get("expert_weight_bits", 4), attr["block_size"]
    ins = list(node.input) + [""] * 13
    out = {}
    for codes, scales, zp in ((ins[2], ins[3], ins[11]), (ins[5], ins[6], ins[12])):
        b, s = arrays[codes], arrays[scales].astype(np.float32)
        e, n, blocks = s.shape
        q = np.stack([b & 0x0F, b >> 4], -1).reshape(e, n, blocks, block) if bits == 4 else b.reshape(e, n, blocks, block)
        if zp:
            z = arrays[zp]
            z = (np.stack([z & 0x0F, z >> 4], -1).reshape(e, n, -1) if bits == 4 else z)[..., :blocks]
        else:
            z = np.full((e, n, blocks), 2 ** (bits - 1), np.uint8)
        w = ((q.astype(np.float32) - z[..., None].astype(np.float32)) * s[..., None]).reshape(e, n, blocks * block)
        name = codes.rsplit("_Q", 1)[0]
        if codes == ins[2] and attr.get("swiglu_fusion") == 1:
            w = np.concatenate([w[:, 0::2], w[:, 1::2]], 1)
        out[name] = w
    return out
