"""The operator sets a graph may hold: standard ai.onnx, and the ONNX Runtime contrib ops that a
quantized export (MatMulNBits, GatherBlockQuantized), the "ort" attention flavour or the MoE op
path (export/moe.py) asks for; the onnx schemas of the latter two."""

from __future__ import annotations

from ..runtime.lazy import lazy_import

onnx = lazy_import("onnx")  # on first use (runtime/lazy.py)

STANDARD_DOMAINS = ("", "ai.onnx")
# what a quantized graph may hold beyond ai.onnx: the linear layers, the embedding lookup
QUANT_OPS = (("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized"))
ORT_FLAVOUR_OPS = (("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "SkipSimplifiedLayerNormalization"))  # the ort flavour's target
MOE_OPS = (("com.microsoft", "MoE"),)  # an MoE target exported with --moe op
QMOE_OPS = (("com.microsoft", "QMoE"),)  # ... and quantized (export/moe.py to_qmoe)


def register_ort_schemas() -> None:
    """onnx has no schemas for ORT's contrib ops; the checker (and the exporter, export/gqa.py and
    export/moe.py) need them for the ones we emit: their inputs, outputs and the attributes we set."""
    OpSchema = onnx.defs.OpSchema
    P, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    T = ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")
    ints = lambda *names, required=True: [OpSchema.Attribute(n, OpSchema.AttrType.INT, "", required=required)  # noqa: E731
                                          for n in names]
    schemas = {
        "GroupQueryAttention": dict(
            inputs=[P(n, "T") for n in ("query", "key", "value")] + [P(n, "C") for n in ("past_key", "past_value")]
            + [P("seqlens_k", "M"), P("total_sequence_length", "M"), P("cos_cache", "T", param_option=opt),
               P("sin_cache", "T", param_option=opt), P("position_ids", "I", param_option=opt)]
            + [P(n, "T", param_option=opt) for n in ("attention_bias", "head_sink")]
            + [P(n, "S", param_option=opt) for n in ("k_scale", "v_scale")]
            + [P(n, "T", param_option=opt) for n in ("q_norm_weight", "k_norm_weight")]
            + [P("query_seqlens", "M", param_option=opt)],  # each row's count of new tokens (ORT >= 1.32)
            outputs=[P("output", "T")] + [P(n, "C") for n in ("present_key", "present_value")],
            type_constraints=[T, ("C", [*T[1], "tensor(int8)"], ""),  # the cache: T, or int8 quantized (export --kv-cache)
                              ("M", ["tensor(int32)"], ""), ("I", ["tensor(int64)"], ""), ("S", ["tensor(float)"], "")],
            attributes=ints("num_heads", "kv_num_heads") + ints("do_rotary", "kv_cache_bit_width", required=False)
            + [OpSchema.Attribute(n, OpSchema.AttrType.STRING, "", required=False) for n in ("k_quant_type", "v_quant_type")]),
        "SkipSimplifiedLayerNormalization": dict(
            inputs=[P(n, "T") for n in ("input", "skip", "gamma")],
            outputs=[P("output", "T"), P("mean", "U", param_option=opt), P("inv_std_var", "U", param_option=opt),
                     P("input_skip_bias_sum", "T", param_option=opt)],
            type_constraints=[T, ("U", ["tensor(float)"], "")],
            attributes=[OpSchema.Attribute("epsilon", OpSchema.AttrType.FLOAT, "")]),
        "MoE": dict(
            inputs=[P("input", "T"), P("router_probs", "T"), P("fc1_experts_weights", "T"),
                    P("fc1_experts_bias", "T", param_option=opt), P("fc2_experts_weights", "T"),
                    P("fc2_experts_bias", "T", param_option=opt), P("fc3_experts_weights", "T", param_option=opt),
                    P("fc3_experts_bias", "T", param_option=opt)],
            outputs=[P("output", "T")],
            type_constraints=[T],
            # every attribute we set must be listed: onnxscript drops the ones a schema lacks, silently
            attributes=ints("k", "normalize_routing_weights", "swiglu_fusion", required=False)
            + [OpSchema.Attribute("activation_type", OpSchema.AttrType.STRING, "", required=False)]
            + [OpSchema.Attribute(n, OpSchema.AttrType.FLOAT, "", required=False)
               for n in ("activation_alpha", "activation_beta", "swiglu_limit")]),
        "QMoE": dict(  # the inputs up to the zero points (quant_type "int")
            inputs=[P("input", "T"), P("router_probs", "T")]
            + [P(f"fc{i}_{what}", ty, param_option=opt if (i == 3 or what != "experts_weights") else
                 OpSchema.FormalParameterOption.Single)
               for i in (1, 2, 3) for what, ty in (("experts_weights", "T1"), ("scales", "T"), ("experts_bias", "T"))]
            + [P(f"fc{i}_zero_points", "T1", param_option=opt) for i in (1, 2, 3)],
            outputs=[P("output", "T")],
            type_constraints=[T, ("T1", ["tensor(uint8)"], "")],
            attributes=ints("k", "normalize_routing_weights", "swiglu_fusion", "expert_weight_bits", "block_size",
                            "weights_prepacked", "accuracy_level", required=False)
            + [OpSchema.Attribute("activation_type", OpSchema.AttrType.STRING, "", required=False)]
            + [OpSchema.Attribute(n, OpSchema.AttrType.FLOAT, "", required=False)
               for n in ("activation_alpha", "activation_beta", "swiglu_limit")]),
    }
    for name, kw in schemas.items():
        try:
            onnx.defs.get_schema(name, 1, "com.microsoft")
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(OpSchema(name, "com.microsoft", 1, **kw))
