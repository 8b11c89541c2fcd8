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


def choose_path(requested: str | None, dtype: str) -> str:
    """`export --moe`: the requested path, or the default: the contrib op where ONNX Runtime
    runs it here (fp32, onnxruntime >= 1.23.1), else standard ops. One line when refused."""
    if requested is None:
        return "op" if dtype == "fp32" and ort_has_op() else "standard"
    if requested not in PATHS:
        raise DFlashError(f"--moe must be one of {', '.join(PATHS)} (got {requested!r})")
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
                layers=list(m.sparse_layers))


def use_path(target, path: str) -> None:
    """Install the graph form `path` on every MoE block of `target` (before tracing).

    "op" stores each gate_up_proj interleaved (g0, u0, g1, u1, ... rows), in place, one layer
    at a time: the layout the CPU kernel reads, written once into the graph's weights."""
    for block in M.blocks(target):
        if path == "op":
            ex = block.experts
            if not ex.interleaved:
                ex.gate_up_proj.data = interleave(ex.gate_up_proj.data)
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
    y = torch.matmul(ex.down_proj[ids], ex.swiglu(h)[..., None])[..., 0]  # T k H
    return (y * weights[..., None]).sum(dim=1)


# -- "op": com.microsoft::MoE ----------------------------------------------------------------


@torch.library.custom_op("dflash::moe", mutates_args=())
def moe_op(x: torch.Tensor, logits: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, k: int,
           normalize: bool) -> torch.Tensor:
    """com.microsoft::MoE's semantics in torch: x [T, H], raw router logits [T, E], fc1
    [E, 2I, H] interleaved, fc2 [E, H, I] -> [T, H] (softmax, top-k, optional renorm, SwiGLU)."""
    weights, ids = M.route(logits, k, normalize)
    ex = M.Experts(fc1.shape[0], fc1.shape[2], fc1.shape[1] // 2)
    ex.gate_up_proj, ex.down_proj, ex.interleaved = torch.nn.Parameter(fc1), torch.nn.Parameter(fc2), True
    with torch.no_grad():
        return ex(x, ids, weights)


@moe_op.register_fake
def _(x, logits, fc1, fc2, k, normalize):
    return x.new_empty(x.shape)


def contrib_experts(block, t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    ex = block.experts
    return moe_op(t, logits, ex.gate_up_proj, ex.down_proj, block.top_k, block.norm_topk_prob)


register_ort_schemas()
_msft = values.Opset("com.microsoft", 1)


def _moe_onnx(x, logits, fc1, fc2, k: int, normalize: bool):
    return _msft.MoE(x, logits, fc1, None, fc2, k=k, activation_type="swiglu", swiglu_fusion=1,
                     normalize_routing_weights=int(normalize))


TRANSLATION = {torch.ops.dflash.moe.default: _moe_onnx}
