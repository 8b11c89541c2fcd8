"""Every MatMulNBits of the target graph multiplies an even number of rows: a row's logits do
not depend on how many rows share the call, so speculative == plain greedy stays exact.

Why, from ONNX Runtime's source (read in the repository's main branch, MLAS under
onnxruntime/core/mlas/lib; 1.32 installed and measured on an AVX-512 VNNI x86 CPU by
tests/test_lossless.py). MatMulNBits flattens its input to M rows
and calls MlasQNBitGemmBatch (qnbitgemm.cpp), which gives each thread a range of at most
StrideM = 128 rows (and N split in 16-aligned columns, never K). Inside a range:

- level 0 (CompFp32), 4-bit weights: SQ4BitGemm_CompFp32 sends a range of `RangeCountM == 1`
  to SQ4BitGemmM1Kernel_CompFp32 (dequantize and dot in one pass); 2 or more rows dequantize B
  into 32-column strips for the SGEMM kernel (GemmFloatKernel). The two sum a row's products
  in different orders: ~1e-6 relative.
- level 0, 8-bit weights: no n-bit fp32 kernel; contrib_ops/cpu/quantization/matmul_nbits.cc
  ComputeBUnpacked dequantizes B and calls MlasGemm, whose MlasSgemmOperation (sgemm.cpp)
  sends `M == 1` to KernelM1TransposeBRoutine and more rows to the tiled kernel.
- level 4 (CompInt8: each row's activations quantized to int8 per block, with block sums):
  SQ4BitGemm_CompInt8 / SQ8BitGemm_CompInt8 call the per-ISA kernel on the whole range. On
  AVX-512 (sqnbitgemm_kernel_avx512_int8_blklen{16,32,64,128}.h, e.g.
  MlasQ4Int8GemmKernelBlkLen128Avx512) rows go in pairs through Q4Int8GemmR2xC4 (each
  accumulator summed with _mm512_reduce_add_ps) and an odd last row through Q4Int8GemmR1xC4
  (FoldAccumulators: the lanes in another order); on AVX2 (sqnbitgemm_kernel_avx2_int8*.h)
  likewise R2 / R1 tiles, and a range of one row takes an M1 kernel of its own. The last-bit
  difference then moves the next layer's int8 rounding, so logits differ by far more.
- A plain step is one row; a verify block of 8 is four pairs. With an even M every range is
  even (128 is), every row takes the multi-row path, and there a row's arithmetic is its own:
  its accumulators, its activation quantization, the same K order for any M. The column split
  between threads depends on M, but columns are cut at multiples of 16, so a column keeps its
  4-column tile. (One exception read, not met: level 0 int8's SGEMM picks its K stride from a
  thread's column range, which depends on M only while M*N*K is under MLAS's threading
  threshold, i.e. matrices far smaller than a real model's.)
- fp32 MatMul (a float head, the drafter) and GatherBlockQuantized (a lookup) gave a row the
  same bits at any row count in the same measurements; only the target's rows decide the
  output, so only the target graph is padded.

Not covered: ARM. KleidiAI takes a GEMV micro-kernel for M == 1 and a GEMM one for more rows
(kleidiai/kai_ukernel_interface.cpp GetKleidiAIGemvUKernel), which even rows avoid, but the
NEON path without KleidiAI (sqnbitgemm_kernel_neon_int8.cpp) tiles 4 rows and sums a leftover
row another way, which they do not. `check` and the accuracy-level probe measure a row alone
against the same row in a block on the machine they run on (export/check_invariance.py).

How: before each MatMulNBits one zero row is appended along the second-to-last axis when the
call's row count is odd (`Concat`), and dropped after it (`Slice`). The parity, the zero block
and the slice end are computed once per group of nodes whose inputs share their leading
(symbolic) dims, from the first such input, so a node pays two cheap ops.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.errors import InternalError
from ..runtime.lazy import lazy_import

onnx = lazy_import("onnx")

PREFIX = "even_rows"  # names of the nodes and tensors this pass adds
INT64_MAX = 2**63 - 1


def _const(name: str, values: list[int]):
    return onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values)


def pad_graph(model) -> int:
    """Pad every MatMulNBits' rows to an even count in `model` (an onnx ModelProto, changed in
    place); -> how many nodes were padded. Idempotent: padded nodes are recognised by name."""
    g = model.graph
    if any(n.name.startswith(PREFIX) for n in g.node):
        return 0
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=False)
    types = {v.name: v.type.tensor_type for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}

    def lead(name: str):
        t = types.get(name)
        if t is None or len(t.shape.dim) < 2:
            return None
        return (t.elem_type, *(d.dim_param or d.dim_value or None for d in t.shape.dim[:-1]))

    g.initializer.extend([_const(f"{PREFIX}/zero", [0]), _const(f"{PREFIX}/two", [2]),
                          _const(f"{PREFIX}/end_open", [INT64_MAX]), _const(f"{PREFIX}/end_drop", [-1])])
    groups: dict = {}  # (dtype, *leading dims) -> (name prefix of its parity and slice end, rank, {K: zero block})
    nodes, padded = [], 0
    for node in g.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            nodes.append(node)
            continue
        a = node.input[0]
        dims = lead(a)
        if dims is None or None in dims:
            raise InternalError(f"{node.name}: the rank or dims of {a} are unknown; cannot pad its rows")
        key, dtype, rank = dims, dims[0], len(dims)  # (dtype, *leading dims): rank = leading + 1
        k = next(x.i for x in node.attribute if x.name == "K")
        tag = f"{PREFIX}/g{len(groups)}"
        if key not in groups:
            # shape of the leading dims, their product's parity, the slice end (-1 drops the pad row)
            nodes += [
                onnx.helper.make_node("Shape", [a], [f"{tag}/lead"], name=f"{tag}/shape", end=-1),
                onnx.helper.make_node("ReduceProd", [f"{tag}/lead"], [f"{tag}/rows"], name=f"{tag}/rows", keepdims=1),
                onnx.helper.make_node("Mod", [f"{tag}/rows", f"{PREFIX}/two"], [f"{tag}/odd"], name=f"{tag}/odd"),
                onnx.helper.make_node("Cast", [f"{tag}/odd"], [f"{tag}/odd_b"], name=f"{tag}/odd_b", to=onnx.TensorProto.BOOL),
                onnx.helper.make_node("Where", [f"{tag}/odd_b", f"{PREFIX}/end_drop", f"{PREFIX}/end_open"],
                                      [f"{tag}/end"], name=f"{tag}/end"),
            ]
            if rank > 2:
                nodes.append(onnx.helper.make_node("Slice", [f"{tag}/lead", f"{PREFIX}/zero", _outer_end(g, rank)],
                                                   [f"{tag}/outer"], name=f"{tag}/outer"))
            groups[key] = (tag, rank, {})
        tag, rank, zeros = groups[key]
        if k not in zeros:
            kname = f"{PREFIX}/K{k}"
            if kname not in {t.name for t in g.initializer}:
                g.initializer.append(_const(kname, [k]))
            parts = ([f"{tag}/outer"] if rank > 2 else []) + [f"{tag}/odd", kname]
            zeros[k] = f"{tag}/zeros{k}"
            nodes += [
                onnx.helper.make_node("Concat", parts, [f"{tag}/zshape{k}"], name=f"{tag}/zshape{k}", axis=0),
                onnx.helper.make_node("ConstantOfShape", [f"{tag}/zshape{k}"], [zeros[k]], name=f"{tag}/zeros{k}",
                                      value=onnx.helper.make_tensor("v", dtype, [1], [0])),
            ]
        axis = rank - 2
        a_even, y_even = f"{PREFIX}/{node.name}/a", f"{PREFIX}/{node.name}/y"
        y = node.output[0]
        nodes.append(onnx.helper.make_node("Concat", [a, zeros[k]], [a_even], name=f"{PREFIX}/{node.name}/pad", axis=axis))
        node.input[0] = a_even
        node.output[0] = y_even
        nodes.append(node)
        nodes.append(onnx.helper.make_node("Slice", [y_even, f"{PREFIX}/zero", f"{tag}/end", _axis(g, axis)], [y],
                                           name=f"{PREFIX}/{node.name}/unpad"))
        padded += 1
    del g.node[:]
    g.node.extend(nodes)
    return padded


def _outer_end(g, rank: int) -> str:
    name = f"{PREFIX}/outer_end{rank}"
    if name not in {t.name for t in g.initializer}:
        g.initializer.append(_const(name, [rank - 2]))
    return name


def _axis(g, axis: int) -> str:
    name = f"{PREFIX}/axis{axis}"
    if name not in {t.name for t in g.initializer}:
        g.initializer.append(_const(name, [axis]))
    return name


def pad_file(path: Path) -> int:
    """pad_graph on a saved graph file (its external data untouched); -> nodes padded."""
    model = onnx.load(str(path), load_external_data=False)
    n = pad_graph(model)
    if n:
        onnx.save_model(model, str(path))
    return n
