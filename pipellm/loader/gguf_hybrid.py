"""What llama.cpp's GGUF files of the models with states hold (gguf_names.py's part for them): Qwen3-Next's and
Qwen3.5's, Granite 4.0-H's, Nemotron-H's, Falcon-H1's, Jamba's and LFM2's metadata as HF config fields, and the
tensors their layers need."""
import numpy as np

from pipellm.model_config import ModelConfig


def f32(x: float) -> float:
    # GGUF stores float32; take its shortest repr so 1e-5 stays 1e-5 rather than 9.999999747e-06
    return float(str(np.float32(x)))


def linear_attention(m, arch: str, layers: int) -> dict:
    """HF config fields of a qwen3next, qwen35 or qwen35moe file's layers (an MTP layer after the last, left
    unread): every full_attention_interval-th full, the others gated delta nets; qwen35's value heads tiled."""
    interval, heads = m("full_attention_interval", 4), m("ssm.time_step_rank")
    return dict(num_hidden_layers=layers, linear_conv_kernel_dim=m("ssm.conv_kernel"),
                linear_key_head_dim=m("ssm.state_size"), linear_num_key_heads=m("ssm.group_count"),
                linear_num_value_heads=heads, linear_value_head_dim=m("ssm.inner_size") // heads,
                layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(layers)], linear_heads_tiled=arch != "qwen3next")


def kv_heads(m, layers: int) -> list[int]:
    """Each layer's KV heads (attention.head_count_kv, a list where they differ): 0 for a layer without attention."""
    kv = m("attention.head_count_kv")
    return kv if isinstance(kv, list) else [kv] * layers


def granite_hybrid(m, hidden: int, experts: int) -> dict:
    """HF config fields of a granitehybrid file (Granite 4.0-H): its attention layers those with KV heads in the
    per-layer attention.head_count_kv, the others Mamba-2 mixers; rotary only where rope.scaling.finetuned says so
    (llama.cpp's switch; its converter writes false for every hybrid model, as they take none)."""
    kv = kv_heads(m, m("block_count"))
    heads, inner = m("ssm.time_step_rank"), m("ssm.inner_size")
    return dict(num_key_value_heads=max(kv), layer_types=["attention" if n else "mamba" for n in kv],
                position_embedding_type="rope" if m("rope.scaling.finetuned", True) else None,
                mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_expand=inner // hidden,
                mamba_n_groups=m("ssm.group_count"), mamba_d_state=m("ssm.state_size"),
                mamba_d_conv=m("ssm.conv_kernel"), num_local_experts=experts,
                num_experts_per_tok=m("expert_used_count", 0) or 1,
                shared_intermediate_size=m("expert_shared_feed_forward_length", 0))  # Bamba has none


def nemotron_h(m, tensors: dict, layers: int, path: str) -> dict:
    """HF config fields of a nemotron_h or nemotron_h_moe file (an MTP layer after the last, left unread): each
    layer's kind from the tensors it holds (llama.cpp tells them by the per-layer head_count_kv and
    feed_forward_length, which the converter has been seen to write all 0 for a dense model's MLP layers)."""
    kinds = {"ssm_in": "linear_attention", "attn_q": "full_attention", "attn_qkv": "full_attention",
             "ffn_up_exps": "moe", "ffn_up": "mlp"}
    types = [next((kind for t, kind in kinds.items() if f"blk.{i}.{t}.weight" in tensors), None)
             for i in range(layers)]
    if None in types:
        raise ValueError(f"{path}: layer {types.index(None)} holds none of ssm_in, attn_q, ffn_up_exps or ffn_up")
    heads, inner = m("ssm.time_step_rank"), m("ssm.inner_size")
    ff = next((tensors[f"blk.{i}.ffn_up.weight"][0][0] for i, t in enumerate(types) if t == "mlp"), 0)
    return dict(layers_block_type=types, num_hidden_layers=layers,
                num_key_value_heads=max(kv_heads(m, layers)),
                intermediate_size=ff, layer_norm_epsilon=f32(m("attention.layer_norm_epsilon")),
                mamba_num_heads=heads, mamba_head_dim=inner // heads, n_groups=m("ssm.group_count"),
                ssm_state_size=m("ssm.state_size"), conv_kernel=m("ssm.conv_kernel"),
                n_routed_experts=m("expert_count", 0), num_experts_per_tok=m("expert_used_count", 0),
                moe_intermediate_size=m("expert_feed_forward_length", 0),
                moe_shared_expert_intermediate_size=m("expert_shared_feed_forward_length", 0),
                routed_scaling_factor=f32(m("expert_weights_scale", 0.0) or 1.0),
                norm_topk_prob=bool(m("expert_weights_norm", False)), n_group=m("expert_group_count", 1) or 1,
                topk_group=m("expert_group_used_count", 1) or 1, moe_latent_size=m("moe_latent_size", None))


def falcon_h1(m, tensors: dict) -> dict:
    """HF config fields of a falcon-h1 file: its multipliers folded into the weights by the converter (1 here); a
    Mamba-2 norm where the file holds one, after the gate (llama.cpp's only order)."""
    heads, inner = m("ssm.time_step_rank"), m("ssm.inner_size")
    return dict(mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
                mamba_n_groups=m("ssm.group_count"), mamba_d_state=m("ssm.state_size"),
                mamba_d_conv=m("ssm.conv_kernel"), mamba_rms_norm="blk.0.ssm_norm.weight" in tensors,
                mamba_norm_before_gate=False, mamba_conv_bias="blk.0.ssm_conv1d.bias" in tensors,
                mlp_bias="blk.0.ffn_gate.bias" in tensors)


def jamba(m, tensors: dict, layers: int, hidden: int, path: str) -> dict:
    """HF config fields of a jamba file: its attention layers those with KV heads in the per-layer
    attention.head_count_kv, its experts layers those with a router; each kind every period-th layer from an
    offset, as HF's Jamba config says them."""
    kv = kv_heads(m, layers)

    def period(flags: list[bool], what: str) -> tuple[int, int]:
        for p in range(1, layers + 1):
            at = flags.index(True) if True in flags else p
            if at < p and all(f == (i % p == at) for i, f in enumerate(flags)):
                return p, at
        raise ValueError(f"{path}: the {what} layers {[i for i, f in enumerate(flags) if f]} are not every n-th "
                         "layer from one offset, as HF's Jamba config says them")
    attn = period([n > 0 for n in kv], "attention")
    experts = period([f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)], "experts")
    return dict(attn_layer_period=attn[0], attn_layer_offset=attn[1], expert_layer_period=experts[0],
                expert_layer_offset=experts[1], num_key_value_heads=max(kv), num_experts=m("expert_count", 1),
                mamba_d_state=m("ssm.state_size"), mamba_d_conv=m("ssm.conv_kernel"),
                mamba_expand=m("ssm.inner_size") // hidden, mamba_dt_rank=m("ssm.time_step_rank"),
                mamba_conv_bias="blk.0.ssm_conv1d.bias" in tensors)


def linear_shapes(mc: ModelConfig, p: str, fused_qkvz: bool) -> dict:
    """A linear-attention layer's tensors (prefix p) and their shapes: Qwen3-Next's b and a in one tensor."""
    h, (hk, hv, dk, dv, kernel) = mc.hidden_size, mc.linear_attention
    conv, value = 2 * hk * dk + hv * dv, hv * dv
    shapes = {p + "conv1d.weight": (conv, 1, kernel), p + "dt_bias": (hv,), p + "A_log": (hv,),
              p + "norm.weight": (dv,), p + "out_proj.weight": (h, value)}
    if fused_qkvz:
        shapes[p + "in_proj_qkvz.weight"] = (conv + value, h)
    else:
        shapes.update({p + "in_proj_qkv.weight": (conv, h), p + "in_proj_z.weight": (value, h)})
    if mc.architecture == "Qwen3NextForCausalLM":
        shapes[p + "in_proj_ba.weight"] = (2 * hv, h)
    else:
        shapes.update({p + "in_proj_b.weight": (hv, h), p + "in_proj_a.weight": (hv, h)})
    return shapes


def mamba_shapes(mc: ModelConfig, p: str) -> dict:
    """A Mamba-2 layer's tensors (prefix p) and their shapes."""
    h, (heads, head_dim, groups, width, kernel) = mc.hidden_size, mc.mamba
    inner = heads * head_dim
    conv = inner + 2 * groups * width
    shapes = {p + "in_proj.weight": (inner + conv + heads, h), p + "conv1d.weight": (conv, 1, kernel),
              p + "dt_bias": (heads,), p + "A_log": (heads,), p + "D": (heads,), p + "out_proj.weight": (h, inner)}
    if mc.mamba_conv_bias:
        shapes[p + "conv1d.bias"] = (conv,)
    if mc.mamba_norm != "none":  # Falcon-H1's may have none
        shapes[p + "norm.weight"] = (inner,)
    return shapes


def _model_shapes(mc: ModelConfig, embedding: str, last_norm: str) -> dict:
    """The embedding's and the last norm's shapes under these names, and the LM head's where it is not tied."""
    h, v = mc.hidden_size, mc.vocab_size
    return {f"model.{embedding}.weight": (v, h), f"model.{last_norm}.weight": (h,),
            **({} if mc.tie_word_embeddings else {"lm_head.weight": (v, h)})}


def _attention_shapes(mc: ModelConfig, p: str, out: str = "o_proj") -> dict:
    """q, k, v and the output projection (named out) of the attention at prefix p."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return {p + "q_proj.weight": (q, h), p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
            f"{p}{out}.weight": (h, q)}


def nemotron_h_shapes(mc: ModelConfig) -> dict:
    """Nemotron-H's tensors under its checkpoints' names (model. for backbone.): a norm and one mixer a layer."""
    h, ff = mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    shapes = _model_shapes(mc, "embeddings", "norm_f")
    for i, kind in enumerate(mc.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        if kind == "linear_attention":
            shapes.update(mamba_shapes(mc, p + "mixer."))
        elif kind == "full_attention":
            shapes.update(_attention_shapes(mc, p + "mixer."))
            if mc.qkv_bias:
                shapes.update({p + "mixer.q_proj.bias": (q,), p + "mixer.k_proj.bias": (kv,),
                               p + "mixer.v_proj.bias": (kv,), p + "mixer.o_proj.bias": (h,)})
        elif kind == "mlp":
            shapes.update({p + "mixer.up_proj.weight": (ff, h), p + "mixer.down_proj.weight": (h, ff)})
            if mc.mlp_bias:
                shapes.update({p + "mixer.up_proj.bias": (ff,), p + "mixer.down_proj.bias": (h,)})
        else:
            width, shared, latent = mc.moe_intermediate_size, mc.shared_expert_intermediate_size, mc.moe_latent_size
            if latent:
                shapes.update({p + "mixer.fc1_latent_proj.weight": (latent, h),
                               p + "mixer.fc2_latent_proj.weight": (h, latent)})
            shapes.update({p + "mixer.gate.weight": (mc.num_experts, h),
                           p + "mixer.gate.e_score_correction_bias": (mc.num_experts,),
                           p + "mixer.shared_experts.up_proj.weight": (shared, h),
                           p + "mixer.shared_experts.down_proj.weight": (h, shared)})
            for e in range(mc.num_experts):
                shapes.update({f"{p}mixer.experts.{e}.up_proj.weight": (width, latent or h),
                               f"{p}mixer.experts.{e}.down_proj.weight": (latent or h, width)})
    return shapes


def falcon_h1_shapes(mc: ModelConfig) -> dict:
    """Falcon-H1's tensors under its checkpoints' names: attention, a Mamba-2 mixer and an MLP in every layer."""
    h, ff = mc.hidden_size, mc.intermediate_size
    shapes = _model_shapes(mc, "embed_tokens", "final_layernorm")
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_ff_layernorm.weight": (h,),
                       **_attention_shapes(mc, p + "self_attn."), p + "feed_forward.gate_proj.weight": (ff, h),
                       p + "feed_forward.up_proj.weight": (ff, h),
                       p + "feed_forward.down_proj.weight": (h, ff), **mamba_shapes(mc, p + "mamba.")})
        if mc.mlp_bias:
            shapes.update({p + "feed_forward.gate_proj.bias": (ff,), p + "feed_forward.up_proj.bias": (ff,),
                           p + "feed_forward.down_proj.bias": (h,)})
    return shapes


def lfm2(m, arch: str, layers: int, eps: float, path: str) -> dict:
    """HF config fields of an lfm2 or lfm2moe file: its attention layers those with KV heads in the per-layer
    attention.head_count_kv, the others short convolutions; feed_forward_length its MLPs' width as it is; lfm2moe's
    experts in all but the leading dense layers, picked by sigmoid scores plus exp_probs_b and renormalised (as
    llama.cpp runs them)."""
    kv = kv_heads(m, layers)
    fields = dict(num_key_value_heads=max(kv), layer_types=["full_attention" if n else "conv" for n in kv],
                  conv_L_cache=m("shortconv.l_cache"), block_auto_adjust_ff_dim=False, norm_eps=eps)
    if arch == "lfm2moe":
        if m("expert_gating_func", 2) != 2:
            raise ValueError(f"{path}: an lfm2moe router without sigmoid scores is not supported")
        fields |= dict(num_experts=m("expert_count"), num_experts_per_tok=m("expert_used_count"),
                       moe_intermediate_size=m("expert_feed_forward_length"),
                       num_dense_layers=m("leading_dense_block_count", 0), use_expert_bias=True, norm_topk_prob=True,
                       routed_scaling_factor=f32(m("expert_weights_scale", 0.0) or 1.0))
    return fields


def lfm2_shapes(mc: ModelConfig) -> dict:
    """LFM2's tensors under its checkpoints' names: a short convolution or attention, then an MLP (or LFM2-MoE's
    experts), in each layer."""
    h, d, ff = mc.hidden_size, mc.head_dim, mc.intermediate_size
    shapes = _model_shapes(mc, "embed_tokens", "embedding_norm")
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "operator_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
        f, width = p + "feed_forward.", mc.moe_intermediate_size if mc.is_moe(i) else ff
        if mc.is_moe(i):
            shapes.update({f + "gate.weight": (mc.num_experts, h), f + "expert_bias": (mc.num_experts,)})
        for e in [f"{f}experts.{e}." for e in range(mc.num_experts)] if mc.is_moe(i) else [f]:
            shapes.update({e + "w1.weight": (width, h), e + "w3.weight": (width, h), e + "w2.weight": (h, width)})
        if mc.is_linear(i):
            shapes.update({p + "conv.in_proj.weight": (3 * h, h), p + "conv.conv.weight": (h, 1, mc.short_conv),
                           p + "conv.out_proj.weight": (h, h)})
            if mc.mamba_conv_bias:
                shapes.update({p + "conv.in_proj.bias": (3 * h,), p + "conv.conv.bias": (h,),
                               p + "conv.out_proj.bias": (h,)})
        else:
            shapes.update({**_attention_shapes(mc, p + "self_attn.", "out_proj"),
                           p + "self_attn.q_layernorm.weight": (d,), p + "self_attn.k_layernorm.weight": (d,)})
    return shapes


def jamba_shapes(mc: ModelConfig) -> dict:
    """Jamba's tensors under its checkpoints' names: Mamba or attention, then experts or an MLP, in each layer."""
    h, ff = mc.hidden_size, mc.intermediate_size
    inner, state, kernel, rank = mc.mamba1
    shapes = _model_shapes(mc, "embed_tokens", "final_layernorm")
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "pre_ff_layernorm.weight": (h,)})
        if mc.is_linear(i):
            m = p + "mamba."
            shapes.update({m + "in_proj.weight": (2 * inner, h), m + "conv1d.weight": (inner, 1, kernel),
                           m + "x_proj.weight": (rank + 2 * state, inner), m + "dt_proj.weight": (inner, rank),
                           m + "dt_proj.bias": (inner,), m + "A_log": (inner, state), m + "D": (inner,),
                           m + "out_proj.weight": (h, inner), m + "dt_layernorm.weight": (rank,),
                           m + "b_layernorm.weight": (state,), m + "c_layernorm.weight": (state,)})
            if mc.mamba_conv_bias:
                shapes[m + "conv1d.bias"] = (inner,)
        else:
            shapes.update(_attention_shapes(mc, p + "self_attn."))
        f = p + "feed_forward."
        experts = [f"{f}experts.{e}." for e in range(mc.num_experts)] if mc.is_moe(i) else [f]
        for e in experts:
            shapes.update({e + "gate_proj.weight": (ff, h), e + "up_proj.weight": (ff, h),
                           e + "down_proj.weight": (h, ff)})
        if mc.is_moe(i):
            shapes[f + "router.weight"] = (mc.num_experts, h)
    return shapes
