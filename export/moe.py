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

import torch
from onnxscript import values

from ..errors import DFlashError
from ..lazy import lazy_import
from ..models import moe as M
from ..models.config import MoeConfig
from .ops import register_ort_schemas

ort = lazy_import("onnxruntime")

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
