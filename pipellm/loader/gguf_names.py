"""What llama.cpp's GGUF layout means per model family: its metadata as an HF config, its tensor names as HF names,
and the shapes each family needs. (How llama.cpp's converter writes them: convert_hf_to_gguf.py.)"""
import re

import numpy as np

from pipellm.loader.gguf_hybrid import (f32, falcon_h1, falcon_h1_shapes, granite_hybrid, jamba, jamba_shapes, lfm2,
                                       lfm2_shapes, linear_attention, linear_shapes, mamba_shapes, nemotron_h,
                                       nemotron_h_shapes)
from pipellm.family_config import CLASSIC as CLASSIC_FAMILY
from pipellm.family_config import PHI_NAMES, STARCODER2_NAMES, renamed
from pipellm.model_config import ModelConfig

# GGUF general.architecture -> (HF class, model_type, whether llama.cpp permuted the Q/K rows for its rotary).
# llama.cpp writes Mistral and Mixtral as "llama" (Mixtral with experts); "mistral" is accepted in case a file says so.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "gemma": ("GemmaForCausalLM", "gemma", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text", False),  # its norms as they are
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),
    "granite": ("GraniteForCausalLM", "granite", True),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe", True),
    "arcee": ("ArceeForCausalLM", "arcee", True),
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", False),
    "exaone4": ("Exaone4ForCausalLM", "exaone4", False),
    "exaone-moe": ("ExaoneMoeForCausalLM", "exaone_moe", False),  # K-EXAONE: DeepSeek V3's experts
    "seed_oss": ("SeedOssForCausalLM", "seed_oss", False),
    "glm4": ("Glm4ForCausalLM", "glm4", False),  # rotary pairs interleaved, as HF's: llama.cpp's NORM rope
    "ernie4_5": ("Ernie4_5ForCausalLM", "ernie4_5", False),  # and these three too
    "command-r": ("CohereForCausalLM", "cohere", False),
    "cohere2": ("Cohere2ForCausalLM", "cohere2", False),
    "ernie4_5-moe": ("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", False),
    "olmoe": ("OlmoeForCausalLM", "olmoe", False),
    "hunyuan-dense": ("HunYuanDenseV1ForCausalLM", "hunyuan_v1_dense", False),  # its base already stretched by alpha
    # V3 (sigmoid router with a selection bias), else V2; rotary pairs interleaved, as HF's (llama.cpp's NORM rope)
    "deepseek2": ("DeepseekV3ForCausalLM", "deepseek_v3", False),
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe", False),
    "dots1": ("Dots1ForCausalLM", "dots1", False),
    "minimax-m2": ("MiniMaxM2ForCausalLM", "minimax_m2", False),  # q/k norms over all heads
    "llama4": ("Llama4ForCausalLM", "llama4_text", False),  # its rotary pairs interleaved, as HF's
    "mistral3": ("Ministral3ForCausalLM", "ministral3", True),
    "mistral4": ("Mistral4ForCausalLM", "mistral4", False),  # deepseek2's file, a softmax router
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next", False),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text", False),  # their value heads tiled (below)
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", False),
    "granitehybrid": ("GraniteMoeHybridForCausalLM", "granitemoehybrid", True),  # Granite 4.0-H: Mamba-2 layers
    # Nemotron-H: its converter permutes the Q/K rows though no layer takes rotary (undone all the same)
    "nemotron_h": ("NemotronHForCausalLM", "nemotron_h", True),
    "nemotron_h_moe": ("NemotronHForCausalLM", "nemotron_h", True),
    "falcon-h1": ("FalconH1ForCausalLM", "falcon_h1", False),  # µP multipliers folded into the weights
    "jamba": ("JambaForCausalLM", "jamba", False),
    "lfm2": ("Lfm2ForCausalLM", "lfm2", False),  # short convolutions among attention layers
    "lfm2moe": ("Lfm2MoeForCausalLM", "lfm2_moe", False),  # and experts
    # LayerNorms (the file's epsilon key), MLPs without a gate, rotary on part of each head (models/classic.py)
    "gptneox": ("GPTNeoXForCausalLM", "gpt_neox", False),  # q, k, v rows as HF's Llama: all q's, all k's, all v's
    "phi2": ("PhiForCausalLM", "phi", False),
    "starcoder2": ("Starcoder2ForCausalLM", "starcoder2", False),
    "nemotron": ("NemotronForCausalLM", "nemotron", False),  # its norms stored as 1 + w
    "stablelm": ("StableLmForCausalLM", "stablelm", False),  # parallel where a layer has no ffn_norm (llama.cpp's)
}
LFM2 = ("lfm2", "lfm2moe")
BAMBA = ("BambaForCausalLM", "bamba", True)  # "granitehybrid" with rotary on part of each head (below)
NEMOTRON = ("nemotron_h", "nemotron_h_moe")
CLASSIC = ("gptneox", "phi2", "starcoder2", "nemotron", "stablelm")
CLASSIC_NAMES = {"PhiForCausalLM": PHI_NAMES, "Starcoder2ForCausalLM": STARCODER2_NAMES}  # their HF names, from
# Llama's
HYBRID = ("qwen3next", "qwen35", "qwen35moe")  # linear-attention layers (gated delta nets) among full ones
DEEPSEEK_V2 = ("DeepseekV2ForCausalLM", "deepseek_v2", False)  # "deepseek2" with a softmax router
COHERE = ("command-r", "cohere2")  # a LayerNorm (its own epsilon key), attention and MLP side by side
OLMO3 = ("Olmo3ForCausalLM", "olmo3", False)  # "olmo2" with sliding layers
MIXTRAL = ("MixtralForCausalLM", "mixtral", True)  # "llama" with expert tensors
GEMMA = ("gemma", "gemma2", "gemma3")  # store every norm weight as w + 1
NORMS_AFTER = ("gemma2", "gemma3", "gemma4")  # also a norm after attention and after the MLP
# Gemma 4's tensors of its own (a layer's, after blk.N.): its output's scale, its router's, its experts' (stacked) and
# their norms
GEMMA4_NAMES = {"layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.weight": "router.proj.weight",
                "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
                "ffn_gate_up_exps.weight": "experts.{e}.gate_up_proj.weight",
                "ffn_down_exps.weight": "experts.{e}.down_proj.weight",
                **{f"{g}.weight": f"{h}.weight" for g, h in (("pre_ffw_norm_2", "pre_feedforward_layernorm_2"),
                                                            ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
                                                            ("post_ffw_norm_2", "post_feedforward_layernorm_2"))}}

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight", "output_norm.bias": "model.norm.bias",
                 "output.bias": "lm_head.bias"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "mlp.gate",
                "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
SHARED_EXPERTS = {f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}  # not Qwen's
_FAMILY_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # kept fused, as HF's Phi-3
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "exaone4": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # the converter names the MLP's input norm after attention where the arch has no ffn_norm
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm"},
    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},
    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
             "ffn_up": "mlp.gate_up_proj"},  # gate and up kept fused, as HF's
    "glm4moe": {"post_attention_norm": "post_attention_layernorm", **SHARED_EXPERTS},
    "exaone-moe": SHARED_EXPERTS,
    "ernie4_5-moe": SHARED_EXPERTS,
    "dots1": SHARED_EXPERTS,
    # newer converters split kv_b_proj into each head's k_b (transposed) and v_b, as llama.cpp's MLA reads them
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj", **SHARED_EXPERTS},
    "llama4": SHARED_EXPERTS,
    "gptneox": {"attn_qkv": "self_attn.qkv_proj"},  # the converter's rows: all q's, all k's, all v's
    "phi2": {"attn_qkv": "self_attn.qkv_proj"},  # older converters': fused, as phi-2 first shipped
}
_FAMILY_NAMES["mistral4"] = _FAMILY_NAMES["deepseek2"]
# a linear-attention layer's: attn_qkv and attn_gate are its q, k, v and z (Qwen3-Next's in_proj_qkvz, split; older
# converters wrote it whole as ssm_in)
_FAMILY_NAMES.update(dict.fromkeys(HYBRID, {
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm"}))
MAMBA_NAMES = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_norm": "mamba.norm",
               "ssm_out": "mamba.out_proj"}
_FAMILY_NAMES["granitehybrid"] = MAMBA_NAMES  # its MLPs' gate and up apart, as llama.cpp's
# Nemotron-H's: a norm and one mixer a layer, under its checkpoints' names
_FAMILY_NAMES.update(dict.fromkeys(NEMOTRON, {
    "attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate", "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj", "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
    "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj"}))
# Falcon-H1's and Jamba's: their MLP (Jamba's router) as their checkpoints name it (Falcon-H1's pre-MLP norm:
# FFN_PRE_NORM, below); Jamba's Mamba's x_proj, dt_proj (its weight and bias: ssm_dt) and norms
FEED_FORWARD_NAMES = {"ffn_norm": "pre_ff_layernorm", "ffn_gate_inp": "feed_forward.router",
                      **{f"ffn_{p}": f"feed_forward.{p}_proj" for p in ("gate", "up", "down")}}
_FAMILY_NAMES["falcon-h1"] = MAMBA_NAMES | FEED_FORWARD_NAMES
_FAMILY_NAMES["jamba"] = MAMBA_NAMES | FEED_FORWARD_NAMES | {
    "ssm_x": "mamba.x_proj", "ssm_dt": "mamba.dt_proj", "ssm_dt_norm": "mamba.dt_layernorm",
    "ssm_b_norm": "mamba.b_layernorm", "ssm_c_norm": "mamba.c_layernorm"}
# LFM2's: its checkpoints' names; its short convolutions' tensors (blk.N.shortconv.conv and so on) as SHORTCONV reads
_FAMILY_NAMES.update(dict.fromkeys(LFM2, {
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "attn_output": "self_attn.out_proj", "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "ffn_gate_inp": "feed_forward.gate"}))
LFM2_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}  # as LFM2-MoE's checkpoints
SHORTCONV = re.compile(r"blk\.(\d+)\.shortconv\.(conv|in_proj|out_proj)\.(weight|bias)")
_GLOBAL_RENAMES = {**dict.fromkeys(NEMOTRON, {"token_embd.weight": "model.embeddings.weight",
                                              "output_norm.weight": "model.norm_f.weight"}),
                   **dict.fromkeys(("falcon-h1", "jamba"), {"output_norm.weight": "model.final_layernorm.weight"})}
FFN_PRE_NORM = re.compile(r"blk\.(\d+)\.ffn_norm")  # falcon-h1's, without .weight
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                "ffn_gate_up_exps": "gate_up_proj"}  # Mistral 4's fused: each expert's gate rows, then its up rows
MLA_ARCHS = ("deepseek2", "mistral4")
BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
SSM_PARAMS = re.compile(r"blk\.(\d+)\.ssm_([ad])")  # A (stored as -exp(A_log)) and Mamba-2's D: no .weight
BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")
BLOCK_REST = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # read into config


def hf_name(name: str, arch: str) -> str | None:
    """HF name of a GGUF tensor; for stacked experts, with {e} where the expert's number goes."""
    names = CLASSIC_NAMES.get(ARCHITECTURES[arch][0])
    llama = _hf_name(name, arch)
    return llama and renamed(llama, names, back=True) if names else llama


def _hf_name(name: str, arch: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_RENAMES.get(arch, {}).get(name, _GLOBAL_NAMES[name])
    if arch == "gemma4" and (match := BLOCK_REST.fullmatch(name)) and match[2] in GEMMA4_NAMES:
        return f"model.layers.{match[1]}.{GEMMA4_NAMES[match[2]]}"
    if arch in LFM2 and name == "token_embd_norm.weight":  # its last norm, as llama.cpp names it
        return "model.embedding_norm.weight"
    if arch in LFM2 and (match := SHORTCONV.fullmatch(name)):
        return f"model.layers.{match[1]}.conv.{match[2]}.{match[3]}"
    if arch == "falcon-h1" and (match := FFN_PRE_NORM.fullmatch(name)):
        return f"model.layers.{match[1]}.pre_ff_layernorm.weight"
    mixer = {"granitehybrid": "mamba", "falcon-h1": "mamba", "jamba": "mamba",
             **dict.fromkeys(NEMOTRON, "mixer")}.get(arch, "linear_attn")
    if match := SSM_PARAMS.fullmatch(name):
        return f"model.layers.{match[1]}.{mixer}.{'A_log' if match[2] == 'a' else 'D'}"
    match = BLOCK_RE.fullmatch(name)
    if not match:
        return None
    kind = match[2]
    if kind == "attn_sinks":  # a parameter of its own, without .weight
        return f"model.layers.{match[1]}.self_attn.sinks"
    if kind == "ssm_dt" and arch != "jamba":  # Mamba-2's dt bias (Jamba's: dt_proj, below)
        return f"model.layers.{match[1]}.{mixer}.dt_bias"
    if arch == "lfm2moe" and kind == "exp_probs_b":
        return f"model.layers.{match[1]}.feed_forward.expert_bias"
    if arch == "lfm2moe" and kind in LFM2_EXPERTS:
        return f"model.layers.{match[1]}.feed_forward.experts.{{e}}.{LFM2_EXPERTS[kind]}.{match[3]}"
    if kind == "exp_probs_b":  # the router's bias that picks the experts, as HF names it
        module = {"ernie4_5-moe": "mlp.moe_statics", **dict.fromkeys(NEMOTRON, "mixer.gate")}.get(arch, "mlp.gate")
        return f"model.layers.{match[1]}.{module}.e_score_correction_bias"
    if kind in EXPERT_NAMES:
        module = {**dict.fromkeys(NEMOTRON, "mixer"), "jamba": "feed_forward"}.get(arch, "mlp")
        return f"model.layers.{match[1]}.{module}.experts.{{e}}.{EXPERT_NAMES[kind]}.{match[3]}"
    names = _FAMILY_NAMES.get("gemma2" if arch in NORMS_AFTER else arch, {})
    module = names.get(kind) or _BLOCK_NAMES.get(kind)
    return None if module is None else f"model.layers.{match[1]}.{module}.{match[3]}"


def stored_as(arch: str, name: str) -> str | None:
    """How the converter changed a tensor's values, to undo at load: "1 + w" (Gemma's and Nemotron's norms,
    Qwen3-Next's but its gated one), "-exp(w)" (Qwen3-Next's and Mamba-2's A_log: the decay rate llama.cpp's graph
    takes), or None."""
    if name.endswith("norm.weight") and (arch in GEMMA + ("nemotron",) or arch in HYBRID
                                         and not name.endswith(".ssm_norm.weight")):
        return "1 + w"
    return "-exp(w)" if name.endswith(".ssm_a") else None


def undo(stored: str | None, values: np.ndarray) -> np.ndarray:
    if stored == "1 + w":
        return values - np.float32(1)
    return np.log(-values) if stored == "-exp(w)" else values


def grouped_v_heads(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """HF's order of a qwen35 file's value-head tensor: the converter tiles the value heads (file head r * Hk + g
    is HF's g * R + r, R value heads a key head), so that llama.cpp broadcasts the key heads."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv or ".linear_attn." not in name:
        return w
    dv, key = cfg["linear_value_head_dim"], 2 * hk * cfg["linear_key_head_dim"]

    def grouped(x, axis, width):  # [R, Hk, width] -> [Hk, R, width] along axis
        return np.swapaxes(x.reshape(*x.shape[:axis], hv // hk, hk, width, *x.shape[axis + 1:]), axis,
                           axis + 1).reshape(x.shape)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # the value rows, after q's and k's
        return np.concatenate([w[:key], grouped(w[key:], 0, dv)])
    if name.endswith(("in_proj_z.weight", "out_proj.weight")):
        return grouped(w, int(name.endswith("out_proj.weight")), dv)
    return grouped(w, 0, 1) if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")) else w


def expected_shapes(cfg: dict, split_kv_b: bool = False, fused_qkvz: bool = False, fused_qkv: bool = False) -> dict:
    """HF name -> shape of every tensor the model needs (experts one by one). split_kv_b: an MLA file's heads'
    up-projections as k_b and v_b (newer converters), not kv_b. fused_qkvz: a qwen3next file's in_proj_qkvz whole
    (older converters). fused_qkv: q, k and v in one tensor (gptneox's, older phi2 files')."""
    mc = ModelConfig.from_hf_dict(cfg)
    if mc.architecture == "NemotronHForCausalLM":
        return nemotron_h_shapes(mc)
    if mc.architecture == "FalconH1ForCausalLM":
        return falcon_h1_shapes(mc)
    if mc.architecture == "JambaForCausalLM":
        return jamba_shapes(mc)
    if mc.architecture in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):
        return lfm2_shapes(mc)
    if mc.architecture == "Gemma4ForCausalLM":
        return _gemma4_shapes(mc)
    h, v, d = mc.hidden_size, mc.vocab_size, mc.head_dim
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    is_gemma = mc.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")  # its norms after attention and MLP
    is_phi3 = mc.architecture == "Phi3ForCausalLM"
    is_glm = mc.architecture == "Glm4ForCausalLM"  # norms before and after attention and MLP
    one_norm = mc.architecture in ("CohereForCausalLM", "Cohere2ForCausalLM", "PhiForCausalLM") or (
        mc.architecture == "StableLmForCausalLM" and mc.parallel_residual)  # one norm a layer
    fused_qkv = fused_qkv or is_phi3 or mc.architecture == "GPTNeoXForCausalLM"
    norms_after = mc.architecture in ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM")  # after only
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not mc.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + ("post_feedforward_layernorm.weight" if norms_after else "input_layernorm.weight"): (h,),
                       p + "self_attn.o_proj.weight": (h, mc.num_heads * mc.v_head_dim if mc.is_mla else q)})
        if not one_norm:
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        if is_glm:
            shapes.update({p + "post_self_attn_layernorm.weight": (h,), p + "post_mlp_layernorm.weight": (h,)})
        if fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
            if mc.qkv_bias:
                shapes[p + "self_attn.qkv_proj.bias"] = (q + 2 * kv,)
        elif mc.is_mla:
            shapes.update(_mla_shapes(mc, p, split_kv_b))
        else:  # Qwen3-Next's q_proj holds the output gate too
            shapes.update({p + "self_attn.q_proj.weight": (q * (1 + mc.attention_output_gate), h),
                           p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h)})
        if mc.qkv_bias and not mc.is_mla and not fused_qkv:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if mc.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if mc.attention_sinks:
            shapes[p + "self_attn.sinks"] = (mc.num_heads,)
        if mc.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d if mc.qk_norm_per_head else q,),
                           p + "self_attn.k_norm.weight": (d if mc.qk_norm_per_head else kv,)})
        if is_gemma:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
        if mc.is_linear(i):  # a gated delta net (or a Mamba-2 mixer) in place of attention
            for name in [n for n in shapes if n.startswith(p + "self_attn.")]:
                del shapes[name]
            shapes.update(mamba_shapes(mc, p + "mamba.") if mc.mamba else
                          linear_shapes(mc, p + "linear_attn.", fused_qkvz))
        if mc.is_moe(i):
            ff, shared = mc.moe_intermediate_size, mc.shared_expert_intermediate_size
            shapes[p + "mlp.gate.weight"] = (mc.num_experts, h)
            if shared:
                one = mc.shared_expert_gated or mc.architecture == "GraniteMoeHybridForCausalLM"  # Qwen2-MoE's
                module = p + ("mlp.shared_expert" if one else "mlp.shared_experts")
                shapes.update({module + ".gate_proj.weight": (shared, h), module + ".up_proj.weight": (shared, h),
                               module + ".down_proj.weight": (h, shared)})
            if shared and mc.shared_expert_gated:
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
            if mc.router_selection_bias:
                module = "mlp.moe_statics" if mc.architecture == "Ernie4_5_MoeForCausalLM" else "mlp.gate"
                shapes[f"{p}{module}.e_score_correction_bias"] = (mc.num_experts,)
            for e in range(mc.num_experts):
                shapes.update({f"{p}mlp.experts.{e}.gate_proj.weight": (ff, h),
                               f"{p}mlp.experts.{e}.up_proj.weight": (ff, h),
                               f"{p}mlp.experts.{e}.down_proj.weight": (h, ff)})
                if mc.swiglu_limit:  # GPT-OSS: biased experts and router
                    shapes.update({f"{p}mlp.experts.{e}.{proj}.bias": (h if proj == "down_proj" else ff,)
                                   for proj in ("gate_proj", "up_proj", "down_proj")})
            if mc.swiglu_limit:
                shapes[p + "mlp.gate.bias"] = (mc.num_experts,)
            continue
        ff = mc.intermediate_size
        if is_phi3 or is_glm:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * ff, h)
        elif not mc.gated_mlp:  # Arcee's MLP, and the classic families', have no gate
            shapes[p + "mlp.up_proj.weight"] = (ff, h)
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h)})
        shapes[p + "mlp.down_proj.weight"] = (h, ff)
        if mc.mlp_bias:
            shapes.update({p + "mlp.up_proj.bias": (ff,), p + "mlp.down_proj.bias": (h,)})
            if mc.gated_mlp:
                shapes[p + "mlp.gate_proj.bias"] = (ff,)
    if mc.architecture in CLASSIC_FAMILY:  # LayerNorms: a bias beside each weight
        shapes |= {name.removesuffix("weight") + "bias": shape for name, shape in shapes.items()
                   if name.endswith("layernorm.weight") or name == "model.norm.weight"}
    if mc.lm_head_bias:
        shapes["lm_head.bias"] = (v,)
    names = CLASSIC_NAMES.get(mc.architecture)
    return {renamed(name, names, back=True): shape for name, shape in shapes.items()} if names else shapes


def _gemma4_shapes(mc: ModelConfig) -> dict:
    """Gemma 4's tensors and their shapes: each layer's heads as wide as its kind's, no v_proj where the values are
    the keys' projection; with experts, each expert's gate and up apart (as the file's are read)."""
    h, heads, ff, moe_ff = mc.hidden_size, mc.num_heads, mc.intermediate_size, mc.moe_intermediate_size
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, h), "model.norm.weight": (h,)}
    if not mc.tie_word_embeddings:
        shapes["lm_head.weight"] = (mc.vocab_size, h)
    norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if mc.num_experts:
        norms += ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"]
    for i in range(mc.num_layers):
        p, (kv, d) = f"model.layers.{i}.", mc.attention_shape(i)
        shapes.update({f"{p}{n}.weight": (h,) for n in norms})
        projections = ("q", "k") if mc.values_are_keys(i) else ("q", "k", "v")
        shapes.update({f"{p}self_attn.{x}_proj.weight": ((heads if x == "q" else kv) * d, h) for x in projections})
        shapes.update({p + "layer_scalar": (1,), p + "self_attn.o_proj.weight": (h, heads * d),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff)})
        if mc.num_experts:
            shapes.update({p + "router.proj.weight": (mc.num_experts, h), p + "router.scale": (h,),
                           p + "router.per_expert_scale": (mc.num_experts,)})
            for e in range(mc.num_experts):
                shapes.update({f"{p}experts.{e}.gate_proj.weight": (moe_ff, h),
                               f"{p}experts.{e}.up_proj.weight": (moe_ff, h),
                               f"{p}experts.{e}.down_proj.weight": (h, moe_ff)})
    return shapes


def _mla_shapes(mc: ModelConfig, p: str, split_kv_b: bool) -> dict:
    """DeepSeek's MLA tensors of one layer (prefix p), and their shapes."""
    h, heads, rank, rope = mc.hidden_size, mc.num_heads, mc.kv_lora_rank, mc.qk_rope_head_dim
    nope, v = mc.head_dim - rope, mc.v_head_dim
    shapes = {p + "self_attn.kv_a_proj_with_mqa.weight": (rank + rope, h),
              p + "self_attn.kv_a_layernorm.weight": (rank,)}
    if mc.q_lora_rank:
        shapes.update({p + "self_attn.q_a_proj.weight": (mc.q_lora_rank, h),
                       p + "self_attn.q_a_layernorm.weight": (mc.q_lora_rank,),
                       p + "self_attn.q_b_proj.weight": (heads * mc.head_dim, mc.q_lora_rank)})
    else:
        shapes[p + "self_attn.q_proj.weight"] = (heads * mc.head_dim, h)
    if split_kv_b:
        shapes.update({p + "self_attn.k_b_proj.weight": (heads, rank, nope),
                       p + "self_attn.v_b_proj.weight": (heads, v, rank)})
    else:
        shapes[p + "self_attn.kv_b_proj.weight"] = (heads * (nope + v), rank)
    if mc.qkv_bias:
        shapes.update({p + "self_attn.kv_a_proj_with_mqa.bias": (rank + rope,)})
        if mc.q_lora_rank:
            shapes[p + "self_attn.q_a_proj.bias"] = (mc.q_lora_rank,)
    return shapes


def _group_routed(m, arch: str, tensors: dict, path: str) -> tuple[tuple, dict]:
    """(ARCHITECTURES entry, HF config fields) of a deepseek2, glm4moe, dots1, mistral4 or exaone-moe file's experts:
    a softmax router (DeepSeek V2, Mistral 4) or a sigmoid one with a selection bias (V3, GLM-4.5, dots.llm1,
    K-EXAONE), in groups, with shared experts; the first layers dense. glm4moe and exaone-moe files hold multi-token
    prediction layers after the last (block_count counts them), left unread."""
    # HF's routers: softmax alone (V2, Mistral 4), sigmoid with a bias (the others); a deepseek2 file holds either
    routers = {"deepseek2": ("softmax", "sigmoid"), "mistral4": ("softmax",)}.get(arch, ("sigmoid",))
    sigmoid = m("expert_gating_func", 2 if routers[0] == "sigmoid" else 1) == 2
    groups = m("expert_group_count", 1) or 1
    biased = f"blk.{m('leading_dense_block_count', 0)}.exp_probs_b.bias" in tensors
    if sigmoid != biased or ("sigmoid" if sigmoid else "softmax") not in routers:
        raise ValueError(f"{path}: a {'sigmoid' if sigmoid else 'softmax'} router {'with' if biased else 'without'} "
                         f"exp_probs_b is not supported for {arch}")
    entry = ARCHITECTURES[arch] if sigmoid or arch == "mistral4" else DEEPSEEK_V2
    return entry, dict(
        architectures=[entry[0]], n_routed_experts=m("expert_count"),
        moe_intermediate_size=m("expert_feed_forward_length"),
        n_shared_experts=m("expert_shared_count", 0), first_k_dense_replace=m("leading_dense_block_count", 0),
        routed_scaling_factor=f32(m("expert_weights_scale", 0.0) or 1.0),
        norm_topk_prob=bool(m("expert_weights_norm", False)), n_group=groups,
        topk_group=m("expert_group_used_count", 1) or 1,
        topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if groups > 1 else "greedy",
        num_hidden_layers=m("block_count") - m("nextn_predict_layers", 0))


def _llama4(m, experts: int, layers: int) -> dict:
    """HF config fields of a llama4 file's layers, as llama.cpp reads them: chunks of 8192 positions in three of four
    layers, the fourth without rotary and with its temperature (0.1, 8192); no chunks (and rotary all but in the
    last layer) where attention.sliding_window is 0; q/k norms but for the 128-expert model (Maverick)."""
    chunked = m("attention.sliding_window", None) != 0
    period = m("attention.sliding_window_pattern", 4)
    dense = ([(i + 1) % period == 0 for i in range(layers)] if isinstance(period, int) else [not p for p in period]) \
        if chunked else [True] * layers
    nope_step = 4 if chunked else layers
    return dict(intermediate_size=m("expert_feed_forward_length"), intermediate_size_mlp=m("feed_forward_length"),
                interleave_moe_layer_step=m("interleave_moe_layer_step"), use_qk_norm=experts != 128,
                attention_chunk_size=8192 if chunked else None, attn_temperature_tuning=chunked, floor_scale=8192,
                attn_scale=0.1, no_rope_layers=[int((i + 1) % nope_step != 0) for i in range(layers)],
                layer_types=["full_attention" if d else "chunked_attention" for d in dense])


def _gemma4(m, tensors: dict, full_theta: float) -> tuple[dict, dict]:
    """(HF config fields, rope_parameters) of a gemma4 file, as llama.cpp reads it: its sliding layers (the
    pattern), their head width (key_length_swa; key_length the full layers') and base; KV heads per kind of layer;
    the full layers' proportional rotary (rope_freqs: 1 for each pair that turns, 1e30 for those that do not), their
    values the keys' projection where they have no attn_v; experts beside the MLP."""
    types = ["sliding_attention" if s else "full_attention" for s in m("attention.sliding_window_pattern")]
    kv = m("attention.head_count_kv")
    heads = {kind: kv[types.index(kind)] if isinstance(kv, list) and kind in types else kv
             for kind in ("sliding_attention", "full_attention")}
    width = m("attention.key_length")
    experts = m("expert_count", 0)
    turning = sum(f == 1.0 for f in tensors["rope_freqs.weight"][1]) if "rope_freqs.weight" in tensors else width // 2
    cfg = dict(head_dim=m("attention.key_length_swa"), global_head_dim=width,
               num_key_value_heads=heads["sliding_attention"], num_global_key_value_heads=heads["full_attention"],
               attention_k_eq_v=f"blk.{types.index('full_attention')}.attn_v.weight" not in tensors,
               layer_types=types, sliding_window=m("attention.sliding_window"), hidden_activation="gelu_pytorch_tanh",
               final_logit_softcapping=m("final_logit_softcapping", None),
               hidden_size_per_layer_input=m("embedding_length_per_layer_input", 0),
               num_kv_shared_layers=m("attention.shared_kv_layers", 0))
    if experts:
        cfg.update(enable_moe_block=True, num_experts=experts, top_k_experts=m("expert_used_count"),
                   moe_intermediate_size=m("expert_feed_forward_length"))
    return cfg, {"full_attention": {"rope_type": "proportional", "rope_theta": full_theta,
                                    "partial_rotary_factor": 2 * turning / width},
                 "sliding_attention": {"rope_type": "default", "rope_theta": f32(m("rope.freq_base_swa", 10000.0))}}


def _classic(m, arch: str, tensors: dict) -> dict:
    """HF config fields of a gptneox, phi2, starcoder2, nemotron or stablelm file, as llama.cpp reads it: the MLP's
    activation (llama.cpp's: GPT-NeoX's exact GELU, Phi's and StarCoder2's tanh one, Nemotron's relu^2, StableLM's
    SwiGLU); biases where the file has them; GPT-NeoX's parallel residual, StableLM's where its layers have no
    ffn_norm; phi2's MLP as wide as its tensors (its converter writes 4 x hidden); StarCoder2's layers over the whole
    context (llama.cpp reads no window for it)."""
    qkv = "blk.0.attn_qkv.bias" in tensors or "blk.0.attn_q.bias" in tensors
    cfg = dict(hidden_act={"gptneox": "gelu", "phi2": "gelu_new", "starcoder2": "gelu_pytorch_tanh",
                           "nemotron": "relu2", "stablelm": "silu"}[arch], attention_bias=qkv, use_bias=qkv,
               use_qkv_bias=qkv, mlp_bias="blk.0.ffn_up.bias" in tensors, sliding_window=None)
    if arch == "stablelm":
        cfg.update(use_parallel_residual="blk.0.ffn_norm.weight" not in tensors,
                   qk_layernorm="blk.0.attn_q_norm.weight" in tensors)
    if arch == "gptneox":
        cfg["use_parallel_residual"] = bool(m("use_parallel_residual", True))
    if arch == "phi2":
        cfg["intermediate_size"] = int(tensors["blk.0.ffn_up.weight"][0][0])
    return cfg


def _mla_config(m, rotated: int) -> dict:
    """HF config fields of a deepseek2 file's latent attention. Newer converters write the MLA widths apart (and
    one KV head); older ones as key_length and value_length."""
    qk = m("attention.key_length_mla", None) or m("attention.key_length")
    return dict(kv_lora_rank=m("attention.kv_lora_rank"), q_lora_rank=m("attention.q_lora_rank", None),
                qk_rope_head_dim=rotated, qk_nope_head_dim=qk - rotated,
                v_head_dim=m("attention.value_length_mla", None) or m("attention.value_length"),
                num_key_value_heads=m("attention.head_count"), rope_interleave=True,
                head_dim=rotated)  # HF's DeepSeek config names the rotary width so


def hf_config(meta, tensors: dict, path: str) -> tuple[str, tuple, dict]:
    """(GGUF architecture, its ARCHITECTURES entry, HF config fields). meta(key, default) reads the metadata;
    tensors: name -> (shape, float values or None) of the tensors the config needs."""
    arch = meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def m(key, default=KeyError):
        return meta(f"{arch}.{key}", default)

    experts = m("expert_count", 0)
    entry = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    hidden, heads = m("embedding_length"), m("attention.head_count")
    head_dim = m("attention.key_length", hidden // heads)
    layers = m("block_count")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: tensor token_embd.weight is missing")
    cfg = {
        "architectures": [entry[0]],
        "vocab_size": int(tensors["token_embd.weight"][0][0]),
        "hidden_size": hidden,
        "intermediate_size": m("feed_forward_length", 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": m("attention.head_count_kv", heads),
        "head_dim": head_dim,
        **({"layer_norm_eps": f32(m("attention.layer_norm_epsilon"))} if arch in COHERE + CLASSIC else {}
           if arch in NEMOTRON
           else {"rms_norm_eps": f32(m("attention.layer_norm_rms_epsilon"))}),
        "max_position_embeddings": m("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta("tokenizer.ggml.eos_token_id", None),
        "torch_dtype": "float32",
    }
    rope = _rope(m, arch, tensors, head_dim, path)
    rotated = m("rope.dimension_count", head_dim)
    if rotated != head_dim and arch not in MLA_ARCHS + NEMOTRON:  # whose rotary dims are qk_rope_head_dim's (below)
        if arch not in ("phi3", "glm4", "glm4moe", "minimax-m2", "granitehybrid") + CLASSIC + HYBRID:
            raise ValueError(f"{path}: partial rotary (rope.dimension_count={rotated}, head_dim={head_dim}) is "
                             "supported for phi3, glm4, glm4moe, minimax-m2, granitehybrid (Bamba), gptneox, phi2, "
                             "nemotron and stablelm only")
        rope["partial_rotary_factor"] = rotated / head_dim
    window = m("attention.sliding_window", None)
    if arch == "mistral" or (arch == "llama" and not experts):  # llama.cpp attends to the whole context otherwise
        cfg["sliding_window"] = window
    if experts:
        cfg.update(num_local_experts=experts, num_experts_per_tok=m("expert_used_count"))
        if arch == "qwen3moe":  # llama.cpp always renormalises the chosen experts' weights
            cfg.update(moe_intermediate_size=m("expert_feed_forward_length"), norm_topk_prob=True)
        elif arch == "qwen2moe":  # and never Qwen2-MoE's
            cfg.update(num_experts=experts, moe_intermediate_size=m("expert_feed_forward_length"),
                       shared_expert_intermediate_size=m("expert_shared_feed_forward_length"), norm_topk_prob=False)
        elif arch == "olmoe":  # llama.cpp never renormalises the chosen experts' weights
            cfg.update(num_experts=experts, norm_topk_prob=False)
        elif arch == "ernie4_5-moe":  # MoE layers: every interleave_moe_layer_step-th from the leading dense ones
            ff = m("expert_feed_forward_length")
            shexp = next((shape[0] for name, (shape, _) in tensors.items() if name.endswith(".ffn_up_shexp.weight")), 0)
            cfg.update(moe_num_experts=experts, moe_k=m("expert_used_count"), moe_intermediate_size=ff,
                       moe_num_shared_experts=shexp // ff, moe_layer_start_index=m("leading_dense_block_count", 0),
                       moe_layer_interval=m("interleave_moe_layer_step", 1))
        elif arch in ("deepseek2", "glm4moe", "dots1", "mistral4", "exaone-moe"):
            entry, extra = _group_routed(m, arch, tensors, path)
            cfg.update(extra)
        elif arch == "llama4":
            entry = ARCHITECTURES[arch]
            cfg.update(_llama4(m, experts, layers))
        elif arch in ("granitehybrid", "jamba", "lfm2moe") + NEMOTRON:  # below
            pass
        elif arch in HYBRID:  # llama.cpp's rules: experts in every layer, their weights renormalised
            cfg.update(num_experts=experts, moe_intermediate_size=m("expert_feed_forward_length"),
                       shared_expert_intermediate_size=m("expert_shared_feed_forward_length", 0), norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[])
        elif arch == "minimax-m2":  # a sigmoid router whose bias picks the experts, their weights renormalised
            if m("expert_gating_func", 2) != 2 or "blk.0.exp_probs_b.bias" not in tensors:
                raise ValueError(f"{path}: a minimax-m2 router without sigmoid scores and exp_probs_b is not "
                                 "supported")
        elif arch == "gpt-oss":  # llama.cpp's rules, not in the file: even layers slide; yarn rounds its ramp's ends
            # (RopeConfig's default, truncate=True; HF's GPT-OSS config says false)
            cfg.update(intermediate_size=m("expert_feed_forward_length"), sliding_window=window,
                       layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
        else:
            cfg["intermediate_size"] = cfg["intermediate_size"] or int(tensors[
                "blk.0.ffn_gate_exps.weight"][0][1])
    if arch in GEMMA:
        # not in the file; llama.cpp's rule: hidden / heads for the 27B models, head_dim otherwise
        big = layers == (46 if arch == "gemma2" else 62)
        cfg.update(sliding_window=window, query_pre_attn_scalar=hidden // heads if big else head_dim,
                   hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=m("final_logit_softcapping", None))
        if arch == "gemma2":
            cfg["attn_logit_softcapping"] = m("attn_logit_softcapping", None)
        elif arch == "gemma3":  # global layers: the file's base and scaling; local ones their own (llama.cpp: 10000)
            local = {"rope_type": "default", "rope_theta": f32(m("rope.freq_base_swa", 10000.0))}
            rope = {"full_attention": rope, "sliding_attention": local}
    if arch == "gemma4":
        extra, rope = _gemma4(m, tensors, rope["rope_theta"])
        cfg.update(extra)
    if arch == "smollm3":  # llama.cpp's rule, not in the file: every 4th layer without rotary
        cfg["no_rope_layer_interval"] = 4
    if arch == "granitehybrid":
        cfg.update(granite_hybrid(m, hidden, experts))
    if arch == "granitehybrid" and rotated != head_dim:  # Bamba, as llama.cpp's converter writes it
        if experts or rotated * 2 != head_dim:
            raise ValueError(f"{path}: a granitehybrid file with rotary on {rotated} of {head_dim} dims is read as "
                             "Bamba, which rotates half of each head and has no experts")
        entry = BAMBA
        cfg.update(architectures=[BAMBA[0]], attn_layer_indices=[i for i, t in enumerate(cfg.pop("layer_types"))
                                                                 if t == "attention"])
    if arch == "falcon-h1":
        cfg.update(falcon_h1(m, tensors))
    if arch == "jamba":
        cfg.update(jamba(m, tensors, layers, hidden, path))
    if arch in LFM2:
        cfg.update(lfm2(m, arch, layers, cfg["rms_norm_eps"], path))
    if arch in NEMOTRON:  # no rotary: context_length (2**20) as the converter writes it
        cfg.update(nemotron_h(m, tensors, layers - m("nextn_predict_layers", 0), path))
    if arch in ("granite", "granitemoe", "granitehybrid"):  # llama.cpp: an attention scale of 0 (or none) is 1 /
        # sqrt(head_dim)
        cfg.update(attention_multiplier=f32(m("attention.scale", 0.0)) or head_dim ** -0.5,
                   embedding_multiplier=f32(m("embedding_scale", 1.0)),
                   residual_multiplier=f32(m("residual_scale", 1.0)), logits_scaling=f32(m("logit_scale", 1.0)))
    if arch == "olmo2" and window:  # OLMo 3: the pattern marks the sliding layers
        if rope["rope_type"] != "default":
            raise ValueError(f"{path}: sliding layers with rope scaling {rope['rope_type']!r} are not supported "
                             "in olmo2 files (the file does not say which layers the scaling is for)")
        pattern = m("attention.sliding_window_pattern", [(i + 1) % 4 != 0 for i in range(layers)])
        entry = OLMO3
        cfg.update(architectures=[OLMO3[0]], sliding_window=window,
                   layer_types=["sliding_attention" if p else "full_attention" for p in pattern])
    if arch in ("seed_oss", "glm4", "glm4moe"):  # biases on q, k and v
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "glm4moe":
        cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if arch in MLA_ARCHS:
        cfg.update(_mla_config(m, rotated))
        if rope["rope_type"] == "yarn":  # llama.cpp's: q.k scaled by mscale_all_dim's mscale squared, cos/sin not
            rope.update(mscale_all_dim=f32(m("rope.scaling.yarn_log_multiplier", 0.0) / 0.1))
            rope["mscale"] = rope["mscale_all_dim"]
    if arch == "mistral3" and m("rope.scaling.yarn_log_multiplier", 0.0):  # yarn's mscale_all_dim, as it is
        rope.update(mscale=1.0, mscale_all_dim=f32(m("rope.scaling.yarn_log_multiplier")))
    if arch in ("mistral3",) + MLA_ARCHS and m("attention.temperature_scale", 0.0):
        # Llama 4's temperature on q, past the context the file names (Ministral 3: yarn's original one)
        span = m("attention.temperature_length", None) if arch in MLA_ARCHS else None
        if span is not None and span != rope.get("original_max_position_embeddings"):
            raise ValueError(f"{path}: attention.temperature_length={span} differs from the rotary's original "
                             f"context ({rope.get('original_max_position_embeddings')}); one length is supported")
        rope["llama_4_scaling_beta"] = f32(m("attention.temperature_scale"))
    if arch in HYBRID:
        cfg.update(linear_attention(m, arch, layers - m("nextn_predict_layers", 0)))
    if arch == "arcee":  # an ungated relu(x)**2 MLP
        cfg["hidden_act"] = "relu2"
    if arch in CLASSIC:
        cfg.update(_classic(m, arch, tensors))
    if arch in ("ernie4_5", "ernie4_5-moe"):  # on every linear layer
        cfg["use_bias"] = "blk.0.attn_q.bias" in tensors
    if arch in COHERE:
        cfg["logit_scale"] = f32(m("logit_scale"))
    if arch == "cohere2":  # llama.cpp's rule, not in the file: every 4th layer full (and without rotary)
        cfg.update(sliding_window=window, layer_types=["sliding_attention" if i % 4 < 3 else "full_attention"
                                                       for i in range(layers)])
    if arch == "seed_oss":  # and on the output, where the file has one
        cfg["attention_out_bias"] = "blk.0.attn_output.bias" in tensors
    if arch in ("exaone4", "exaone-moe"):  # the file's sliding layers, else llama.cpp's rule: the 64-layer EXAONE
        # 4's every 4th is full
        pattern = m("attention.sliding_window_pattern",
                    [i % 4 != 3 for i in range(layers)] if layers == 64 and arch == "exaone4" else [])
        cfg["sliding_window"] = None  # no sliding layer: every layer takes rotary (HF's and llama.cpp's rule)
        if any(pattern):
            cfg.update(sliding_window=window or 4096,
                       layer_types=["sliding_attention" if p else "full_attention" for p in pattern])
    if arch == "phi3":
        cfg["sliding_window"] = window or None
        if "rope_factors_long.weight" in tensors:  # HF's Phi-3 takes it from here over rope_parameters (default 4096)
            cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    cfg["rope_parameters"] = rope
    return arch, entry, cfg


def _rope(m, arch: str, tensors: dict, head_dim: int, path: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": f32(m("rope.freq_base", 10000.0))}
    scaling = m("rope.scaling.type", "none")
    factor = m("rope.scaling.factor", m("rope.scale_linear", 1.0))
    if scaling == "linear" or (scaling == "none" and factor != 1.0):
        rope.update(rope_type="linear", factor=f32(factor))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=f32(factor),
                    original_max_position_embeddings=m("rope.scaling.original_context_length"),
                    beta_fast=f32(m("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=f32(m("rope.scaling.yarn_beta_slow", 1.0)))
    elif scaling not in ("none", "longrope"):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (none, linear, yarn, longrope, and "
                         "llama3 by rope_freqs)")
    if "rope_factors_long.weight" in tensors:  # Phi-3 longrope: the factors are tensors
        rope.update(rope_type="longrope", long_factor=tensors["rope_factors_long.weight"][1],
                    short_factor=tensors["rope_factors_short.weight"][1],
                    original_max_position_embeddings=m("rope.scaling.original_context_length"))
    if "rope_freqs.weight" in tensors:  # Llama 3: each frequency's divisor, as llama.cpp computed it
        rope["freq_factors"] = tensors["rope_freqs.weight"][1]
    return rope
