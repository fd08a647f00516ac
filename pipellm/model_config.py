"""A model's shape as its HF config.json gives it (ModelConfig, with rope_config.py's RopeConfig for its rotary
positions and family_config.py's rules for the families whose configs say things their own way), and the
architectures pipellm runs. The engine's settings: config.py."""
import json
import math
import os
from dataclasses import dataclass, field

from pipellm.family_config import (AFMOE, BAMBA, CLASSIC, FALCON_H1, GELUS, GEMMA4, GRANITE_HYBRID, GRANITE_MOE_SWA,
                                   GRANITE_SWA, JAMBA, LFM2, LFM2_MOE, MAMBA_LAYER_TYPES, NEMOTRON_H, PHIMOE, afmoe,
                                   bamba, classic, cohere2_moe, exaone_layer_types, falcon_h1, fp8_weight_block,
                                   gemma4, granite_hybrid, granite_swa, group_router, jamba, latent_attention, lfm2,
                                   nemotron_h, phimoe, same_each_layer)
from pipellm.rope_config import RopeConfig
from pipellm.vision_language import VISION_LANGUAGE, text_config

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                "Exaone4ForCausalLM", "SeedOssForCausalLM", "MinistralForCausalLM", "Glm4ForCausalLM",
                "Ernie4_5ForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "HunYuanDenseV1ForCausalLM",
                "ArceeForCausalLM", "ApertusForCausalLM", "Ministral3ForCausalLM", "Llama4ForCausalLM",
                "Qwen3_5ForCausalLM", "HeliumForCausalLM", GRANITE_SWA)
# linear-attention layers (gated delta nets) among gated full-attention ones
HYBRID_FAMILY = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
# latent attention (GLM-4.7-Flash's Glm4MoeLite is DeepSeek V3's model; Mistral 4 is too, with a softmax router)
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                   "YoutuForCausalLM", "MiniCPM3ForCausalLM")  # (Youtu, MiniCPM3: dense MLPs in every layer)
SOFTMAX_GROUP_ROUTED = ("DeepseekV2ForCausalLM", "Mistral4ForCausalLM")
# DeepSeek's router: experts in groups, shared experts; all but V2's and Mistral 4's by sigmoid scores with a
# selection bias
# (Solar Open: Llama's attention, GLM-4.5's experts in every layer; K-EXAONE: EXAONE 4's attention before Llama's
# norms)
EXAONE_MOE = "ExaoneMoeForCausalLM"
MINICPM5_MOE = "MiniCPM5MoeForCausalLM"  # Llama's attention with Qwen3-Next's output gate
GROUP_ROUTED = DEEPSEEK_FAMILY + ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "SolarOpenForCausalLM", EXAONE_MOE,
                                  MINICPM5_MOE)
COHERE_FAMILY = ("CohereForCausalLM", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM")
# q/k norms over all heads at once (FlexOlmo: OLMo 2's layers with OLMoE's experts)
OLMO_FAMILY = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM", "FlexOlmoForCausalLM")
ALL_HEADS_QK_NORM = OLMO_FAMILY + ("MiniMaxM2ForCausalLM",)
MOE_FAMILY = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM",
              "Ernie4_5_MoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", GRANITE_MOE_SWA,
              "OlmoeForCausalLM", "Cohere2MoeForCausalLM", AFMOE,
              "MiniMaxM2ForCausalLM", "Llama4ForCausalLM", "HunYuanMoEV1ForCausalLM", "Qwen3NextForCausalLM",
              "Qwen3_5MoeForCausalLM", GRANITE_HYBRID, "FlexOlmoForCausalLM") + GROUP_ROUTED
GRANITE_FAMILY = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", GRANITE_SWA,
                  GRANITE_MOE_SWA,
                  GRANITE_HYBRID)  # scaled
GEMMA_FAMILY = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "VaultGemmaForCausalLM", GEMMA4)
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + MOE_FAMILY + GEMMA_FAMILY + ("GPT2LMHeadModel", NEMOTRON_H, FALCON_H1,
                                                                       JAMBA, LFM2, LFM2_MOE, BAMBA, PHIMOE) + CLASSIC
# the names some releases give an architecture pipellm runs: Phi-3.5-MoE's, InternLM3's (Llama's model, as HF runs it)
ALIASES = {"PhiMoEForCausalLM": PHIMOE, "InternLM3ForCausalLM": "LlamaForCausalLM",
           "MiniCPM5MoEForCausalLM": MINICPM5_MOE, "ExaoneMoEForCausalLM": EXAONE_MOE}
LOCAL_LAYER_TYPES = ("sliding_attention", "chunked_attention")  # layers that attend over part of the context


@dataclass
class ModelConfig:
    architecture: str               # HF class name, one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int               # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int          # MLP width
    max_position_embeddings: int
    norm_eps: float                 # RMSNorm (Llama family) or LayerNorm (GPT-2) epsilon
    rope: RopeConfig = field(default_factory=RopeConfig)  # unused by GPT-2 (learned positions)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2, and Llama with attention_bias
    o_bias: bool = False            # Llama with attention_bias
    mlp_bias: bool = False          # Llama with mlp_bias, ERNIE 4.5 with use_bias
    gated_mlp: bool = True          # False: down(act(up(x))) (GPT-NeoX, Phi, StarCoder2; relu2 and xielu always)
    parallel_residual: bool = False  # x + attention(norm1(x)) + mlp(norm2(x)) (GPT-NeoX; StableLM's: one norm)
    sliding_window: int | None = None  # sliding layers attend to the last sliding_window keys only
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | LOCAL_LAYER_TYPES; () = all full, or all
    #                                    sliding when sliding_window is set (Mistral)
    rope_local: RopeConfig | None = None  # Gemma 3: rotary of the sliding layers (another base)
    qk_norm: bool = False           # Qwen3, Gemma 3: RMSNorm over each head of q and k before rotary
    hidden_act: str = "silu"        # MLP gate: silu, or gelu_pytorch_tanh (Gemma); relu2, xielu: Arcee's, Apertus's
    #                                 ungated MLPs
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    num_experts: int = 0            # mixture of experts (Mixtral, Qwen3-MoE); 0 = dense MLPs
    num_experts_per_tok: int = 0    # experts each token is routed to
    moe_intermediate_size: int = 0  # width of one expert's MLP
    norm_topk_prob: bool = True     # renormalise the chosen experts' router weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers with a dense MLP among the MoE ones
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token takes, weighted by a sigmoid gate
    shared_expert_gated: bool = True    # ERNIE 4.5 MoE: its shared experts (one MLP) added as they are
    shared_expert_average: bool = False  # Cohere 2 MoE: the shared experts' output averaged with the routed ones
    router_selection_bias: bool = False  # ERNIE 4.5 MoE: experts picked by softmax + a bias, weighed without it
    router_softmax_after_topk: bool = False  # GPT-OSS, Granite MoE: the top-k logits softmaxed among themselves
    nope_layers: tuple[int, ...] = ()   # SmolLM3: layers whose q and k take no rotary positions
    qk_norm_per_head: bool = True       # qk_norm over each head's values; OLMo 2: over all heads' at once
    qk_norm_after_rope: bool = False    # Hunyuan: q and k normed after their rotary, not before
    # Granite: the embedding, each block's output before it joins the residual, and the logits (divided) scaled;
    # attention_multiplier the attention's scale
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # GPT-OSS: a learned logit per head that joins each softmax's denominator (attention "sinks"); experts with
    # biases whose gate is clamped above and up on both sides at swiglu_limit, gated by gate * sigmoid(alpha * gate)
    # times (up + 1); a router with a bias whose top-k logits are softmaxed (0: plain SwiGLU experts)
    attention_sinks: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # DeepSeek V2/V3's multi-head latent attention (models/deepseek.py): q through a rank-q_lora_rank bottleneck (0:
    # one q_proj); each token's keys and values from one kv_lora_rank latent (0: not MLA) and a qk_rope_head_dim
    # rotary key all heads share. head_dim is q.k's width (the unrotated dims, then the rotary ones), v_head_dim v's.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False   # the checkpoint's rotary pairs are (2i, 2i+1): reordered at load
    # DeepSeek's router: sigmoid scores (V3) or softmax (V2, Mistral 4); the experts in expert_groups groups, of
    # which the best expert_groups_kept (by their top two's sum, or with group_by_top_expert their top expert's: V2)
    # are chosen from; weights scaled
    router_sigmoid: bool = False
    expert_groups: int = 1
    expert_groups_kept: int = 1
    group_by_top_expert: bool = False
    routed_scaling_factor: float = 1.0
    router_norm_eps: float = 0.0  # LFM2-MoE: added to the chosen weights' sum that renormalises them
    router_jitter_eps: float = 0.0  # Phi-MoE's sparsemixer router (its router_jitter_noise); 0: another router
    lm_head_bias: bool = False    # Phi-MoE's
    moe_latent_size: int = 0  # Nemotron 3 Super: the routed experts work on a projection this wide (0: none)
    fp8_block: tuple[int, ...] = ()  # the checkpoint's FP8 weights' (rows, columns) a scale (quant/fp8.py); () none
    # Llama 4: its chunked layers attend within chunks of attention_chunk positions only (0: none); q and k
    # RMS-normed without weights after their rotary (qk_l2_norm, the layers with rotary only); the queries of the
    # layers without rotary scaled by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale))
    # (nope_temperature: (floor_scale, attn_scale), () none); experts' inputs, not outputs, weighed by the router
    attention_chunk: int = 0
    experts_in_out: bool = False    # stacked experts held [E, in, out] (Llama 4's), not [E, out, in], square ones too
    qk_l2_norm: bool = False
    nope_temperature: tuple[float, ...] = ()
    router_weights_input: bool = False
    # Qwen3-Next, Qwen3.5: the "linear_attention" layers of layer_types are gated delta nets
    # (models/linear_attention.py) of (key heads, value heads, key head width, value head width, conv kernel); the
    # full-attention layers' outputs gated by a sigmoid of a second q_proj (attention_output_gate)
    linear_attention: tuple[int, ...] = ()
    linear_heads_tiled: bool = False  # llama.cpp's qwen35 files: value head h takes key head h % key heads
    # Granite 4.0-H: its "linear_attention" layers are Mamba-2 mixers of (heads, head width, groups, state width,
    # conv kernel); their convolution's bias and their projections' biases
    mamba: tuple[int, ...] = ()
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_out_bias: bool = False
    # Falcon-H1: attention and a Mamba-2 mixer side by side in each layer ("hybrid" layer_types); the Mamba-2
    # output normed after its gate ("gated": Granite's, Nemotron-H's), before it ("norm_then_gate") or not at all
    # ("none"); µP multipliers: (attention in, attention out, ssm in, ssm out, the in_proj's z, x, B, C and dt, the
    # MLP's gate and down), () none
    mamba_norm: str = "gated"
    mup_multipliers: tuple[float, ...] = ()
    # Jamba: its "linear_attention" layers are Mamba (-1) mixers of (width, state width, conv kernel, dt rank)
    mamba1: tuple[int, ...] = ()
    short_conv: int = 0  # LFM2: its "linear_attention" layers are gated short convolutions of this many taps
    attention_output_gate: bool = False
    text_of: str = ""  # the vision-language checkpoint whose text model this is (vision_language.py); "" none
    # Gemma 4: its full-attention layers' head width and KV heads (0: head_dim's, num_kv_heads), and their values
    # the projection of their keys (k_eq_v: no v_proj)
    global_head_dim: int = 0
    num_global_kv_heads: int = 0
    k_eq_v: bool = False

    def __post_init__(self):
        if self.hidden_act in ("relu2", "xielu"):
            self.gated_mlp = False
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"the model's num_attention_heads={self.num_heads} is not a multiple of its "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.linear_attention and self.linear_attention[1] % self.linear_attention[0]:
            raise ValueError(f"the model's linear_num_value_heads={self.linear_attention[1]} is not a multiple of its "
                             f"linear_num_key_heads={self.linear_attention[0]}")
        if self.num_heads % (self.num_global_kv_heads or 1):
            raise ValueError(f"the model's num_attention_heads={self.num_heads} is not a multiple of its "
                             f"num_global_key_value_heads={self.num_global_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"the model's layer_types has {len(self.layer_types)} entries for its "
                             f"{self.num_layers} layers")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head width) of the layer's attention: Gemma 4's full-attention layers have their own."""
        if self.global_head_dim and self.layer_types[layer] == "full_attention":
            return self.num_global_kv_heads or self.num_kv_heads, self.global_head_dim
        return self.num_kv_heads, self.head_dim

    def values_are_keys(self, layer: int) -> bool:
        """Whether the layer's values are its keys' projection (Gemma 4's full-attention layers with k_eq_v)."""
        return self.k_eq_v and self.layer_types[layer] == "full_attention"

    def cache_shape(self, layer: int) -> tuple[int, int]:
        """(heads, width) the layer caches per token: MLA's one latent with its rotary key, which K and V share."""
        return (1, self.kv_lora_rank + self.qk_rope_head_dim) if self.is_mla else self.attention_shape(layer)

    def attention_params(self, layer: int) -> int:
        """Weights of the layer's attention, biases and norms aside."""
        if not self.is_mla:
            kv_heads, head_dim = self.attention_shape(layer)
            h, q = self.hidden_size, self.num_heads * head_dim
            values = 0 if self.values_are_keys(layer) else kv_heads * head_dim
            return h * (q + kv_heads * head_dim + values) + q * h
        h, q = self.hidden_size, self.num_heads * self.head_dim
        nope, rank = self.head_dim - self.qk_rope_head_dim, self.kv_lora_rank
        q_params = (h + q) * self.q_lora_rank if self.q_lora_rank else h * q
        return q_params + h * (rank + self.qk_rope_head_dim) + rank * self.num_heads * (nope + self.v_head_dim) \
            + self.num_heads * self.v_head_dim * h

    def layer_weights(self, layer: int, picked: bool = False) -> int:
        """Weights of a layer's matmuls (norms, biases and convolutions aside): all its experts', or with picked
        those one token multiplies (the router's and its top-k experts')."""
        h, kind = self.hidden_size, self.layer_types[layer] if self.layer_types else "full_attention"
        if self.is_linear(layer) and self.mamba:  # in_proj: z, x, B, C and dt; out_proj (Falcon-H1's: attention too)
            heads, head_dim, groups, state, _ = self.mamba
            mixer = h * (2 * heads * head_dim + 2 * groups * state + heads) + heads * head_dim * h \
                + self.attention_params(layer) * (kind == "hybrid")
        elif self.is_linear(layer) and self.mamba1:  # in_proj: x and z; x_proj: dt, B and C; dt_proj; out_proj
            inner, state, _, rank = self.mamba1
            mixer = h * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * h
        elif self.is_linear(layer) and self.short_conv:  # in_proj: B, C and x; out_proj
            mixer = 4 * h * h
        elif self.is_linear(layer):  # q, k, v, z, b and a; out_proj
            hk, hv, dk, dv, _ = self.linear_attention
            mixer = h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * h
        elif kind in ("mlp", "moe"):  # Nemotron-H's MLP and experts layers
            mixer = 0
        else:
            mixer = self.attention_params(layer) + self.attention_output_gate * h * self.num_heads * self.head_dim
        if self.architecture == NEMOTRON_H and kind not in ("mlp", "moe"):
            return mixer  # each of its layers one mixer
        matrices = 2 if self.is_gpt2 or not self.gated_mlp else 3  # an MLP's: no gate, or one
        if not self.is_moe(layer):
            return mixer + matrices * h * self.intermediate_size
        experts, shared = self.num_experts_per_tok if picked else self.num_experts, \
            self.shared_expert_intermediate_size
        latent = self.moe_latent_size
        return mixer + h * self.num_experts + matrices * (latent or h) * experts * self.moe_intermediate_size \
            + 2 * h * latent + matrices * h * shared + h * (shared > 0 and self.shared_expert_gated)

    @property
    def is_gpt2(self) -> bool:
        return self.architecture == "GPT2LMHeadModel"

    @property
    def max_context(self) -> int:
        """Tokens a sequence may hold: dynamic and yarn rotary stretch the trained context by their factor."""
        rope = self.rope
        if rope.rope_type == "dynamic":
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn":
            return max(self.max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
        return self.max_position_embeddings

    def is_sliding(self, layer: int) -> bool:
        """Whether the layer attends over part of the context (a sliding window, or Llama 4's chunks)."""
        if self.sliding_window is None and not self.attention_chunk:
            return False
        return not self.layer_types or self.layer_types[layer] in LOCAL_LAYER_TYPES

    @property
    def keeps_states(self) -> bool:
        """Whether some layers keep a state per sequence (linear attention, Mamba-2) instead of a KV cache."""
        return bool(self.linear_attention or self.mamba or self.mamba1 or self.short_conv)

    def is_linear(self, layer: int) -> bool:
        """Whether the layer keeps a state per sequence: a linear-attention (or Mamba-2) one, and Falcon-H1's."""
        return self.keeps_states and self.layer_types[layer] in ("linear_attention", "hybrid")

    def has_kv_cache(self, layer: int) -> bool:
        """Whether the layer caches keys and values: not one with a state, nor Nemotron-H's MLP and experts ones."""
        return not self.layer_types or self.layer_types[layer] not in ("linear_attention", "mlp", "moe")

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear(i) for i in range(self.num_layers))

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @classmethod
    def from_pretrained(cls, folder: str) -> "ModelConfig":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no config.json; a model folder needs config.json and *.safetensors")
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, path)

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else archs
        if "InternLM3ForCausalLM" in archs:  # HF reads its biases so: q, k, v and o's, and the MLP's
            d = {"attention_bias": d.get("qkv_bias", False), "mlp_bias": d.get("bias", False)} | d
            if d["attention_bias"] != d["mlp_bias"]:
                raise ValueError(f"{source}: InternLM3 with qkv_bias={d['attention_bias']} and bias={d['mlp_bias']} "
                                 "is not supported (HF's neither: one setting for both)")
        archs = [ALIASES.get(a, a) for a in archs]
        wrapper = next((a for a in archs if a in VISION_LANGUAGE), None)
        if wrapper is not None:
            d = text_config(d, wrapper, source)
            archs = d["architectures"]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            inside = f" (the text model of {wrapper})" if wrapper else ""
            raise ValueError(f"{source}: architecture {archs or d.get('model_type')}{inside} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        quant = d.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        fp8_block = fp8_weight_block(quant, source) if method == "fp8" else ()
        if method not in (None, "fp8") and not (method == "mxfp4" and arch == "GptOssForCausalLM"):
            raise ValueError(f"{source}: weights quantized as {method!r} are not supported (block-scaled fp8 and "
                             "GPT-OSS's mxfp4 are): "
                             "use the unquantized checkpoint (quantization='int8' or 'int4' compacts it at load) "
                             "or a GGUF file")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if arch == "GPT2LMHeadModel":
            for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
                if d.get(flag):
                    raise ValueError(f"{source}: GPT-2 option {flag}=true is not supported")
            n_embd, n_head = d["n_embd"], d["n_head"]
            return cls(arch, d["vocab_size"], n_embd, d["n_layer"], n_head, n_head, n_embd // n_head,
                       d.get("n_inner") or 4 * n_embd, d["n_positions"], d.get("layer_norm_epsilon", 1e-5),
                       tie_word_embeddings=d.get("tie_word_embeddings", True), eos_token_ids=eos_ids,
                       fp8_block=fp8_block)
        family = {}  # fields a family's config gives its own way
        if arch == NEMOTRON_H:
            d, family = nemotron_h(d, source)
            family |= group_router(d, source, arch) if family["num_experts"] else {}
        elif arch == FALCON_H1:
            d, family = falcon_h1(d, source)
        elif arch == JAMBA:
            d, family = jamba(d, source)
        elif arch in (LFM2, LFM2_MOE):
            d, family = lfm2(d, source, moe=arch == LFM2_MOE)
        elif arch == BAMBA:
            d, family = bamba(d, source)
        elif arch == PHIMOE:
            family = phimoe(d, source)
        elif arch in CLASSIC:
            d, family = classic(d, arch, source)
        elif arch == GEMMA4:
            d, family = gemma4(d, source)
        elif arch in (GRANITE_SWA, GRANITE_MOE_SWA):
            d, family = granite_swa(d, source)
        elif arch == "Cohere2MoeForCausalLM":
            d, family = cohere2_moe(d, source)
        elif arch == AFMOE:
            d, family = afmoe(d, source)
        elif arch in ("Glm4ForCausalLM", "Glm4MoeForCausalLM"):  # HF's default: half of each head rotated
            d = {"partial_rotary_factor": 0.5} | d
        elif arch == "SolarOpenForCausalLM":  # experts in every layer: no dense MLP's width; HF's default base
            d = {"intermediate_size": d["moe_intermediate_size"], "rope_theta": 1e6} | d
        elif arch == MINICPM5_MOE:  # HF's defaults
            d = {"rope_theta": 5e6, "first_k_dense_replace": 1, "routed_scaling_factor": 3.66} | d
            family = dict(attention_output_gate=True)
        elif arch == EXAONE_MOE:  # DeepSeek's router under its own keys (HF's defaults)
            d = {"n_routed_experts": d.get("num_experts", 64), "n_shared_experts": d.get("num_shared_experts", 1),
                 "first_k_dense_replace": 1, "routed_scaling_factor": 2.5} | exaone_layer_types(d, source)
        elif arch == "Exaone4ForCausalLM":
            d = exaone_layer_types(d, source)
        is_gemma = arch in GEMMA_FAMILY
        act = d.get("hidden_activation" if is_gemma else "hidden_act") or d.get("hidden_act") or "silu"
        classic_act = arch in CLASSIC and act in (("relu2",) if arch == "NemotronForCausalLM" else GELUS)
        if act not in ("silu", "gelu_pytorch_tanh") and not classic_act and (act, arch) not in (
                ("relu2", "ArceeForCausalLM"), ("relu2", NEMOTRON_H), ("xielu", "ApertusForCausalLM")):
            raise ValueError(f"{source}: activation {act!r} is not supported (silu, gelu_pytorch_tanh; Arcee's and "
                             "Nemotron's relu2, Apertus's xielu; GPT-NeoX's, Phi's and StarCoder2's GELUs)")
        layers = d["num_hidden_layers"]
        window = d.get("sliding_window")
        if window is not None and window >= d.get("max_position_embeddings", math.inf):
            window = None  # as long as the context (Phi-3.5-MoE's): no layer attends over less of it
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                    "SmolLM3ForCausalLM") \
                and not d.get("use_sliding_window", False):
            window = None
        layer_types = tuple(d.get("layer_types") or ())
        if arch == "Gemma3ForCausalLM" and not layer_types:  # older configs: every n-th layer is global
            pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
            layer_types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(layers))
        if arch in ("Gemma2ForCausalLM", "VaultGemmaForCausalLM") and not layer_types:
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        llama4 = arch == "Llama4ForCausalLM"
        uses_rope = d.get("no_rope_layers") or [int((i + 1) % (d.get("no_rope_layer_interval") or 4) != 0)
                                                for i in range(layers)]  # SmolLM3's and Llama 4's: 0 = no rotary
        chunk = (d.get("attention_chunk_size") or 0) if llama4 else 0
        if llama4 and not layer_types:  # the layers with rotary attend in chunks
            layer_types = tuple("chunked_attention" if r and chunk else "full_attention" for r in uses_rope)
        hybrid = arch in HYBRID_FAMILY
        if arch == GRANITE_HYBRID:
            layer_types = tuple(MAMBA_LAYER_TYPES.get(t, t) for t in layer_types) or ("linear_attention",) * layers
            window = None
        elif hybrid:  # older configs: every full_attention_interval-th layer full
            interval = d.get("full_attention_interval") or 4
            layer_types = layer_types or tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                               for i in range(layers))
            d, window = {"partial_rotary_factor": 0.25} | d, None  # HF's default for both
        elif not any(t in LOCAL_LAYER_TYPES for t in layer_types):
            layer_types = ()
            if arch not in ("MistralForCausalLM", "Ministral3ForCausalLM") and d.get("layer_types"):
                window = None  # every layer is full (Qwen's layer_types without use_sliding_window)
        if any(t not in ("full_attention", "sliding_attention") + LOCAL_LAYER_TYPES[1:] * bool(chunk)
               + ("linear_attention",) * (hybrid or arch == GRANITE_HYBRID) for t in layer_types):
            raise ValueError(f"{source}: layer_types {sorted(set(layer_types))} are not supported "
                             "(full_attention, sliding_attention)")
        params = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_local = None
        if "full_attention" in params or "sliding_attention" in params:  # per layer kind (Gemma 3)
            rope = RopeConfig.from_hf(params.get("full_attention") or {}, d, source)
            rope_local = RopeConfig.from_hf(params.get("sliding_attention") or {}, d, source)
        else:
            rope = RopeConfig.from_hf(params, d, source)
            if arch == "Gemma3ForCausalLM":  # older configs: local layers use rope_local_base_freq, unscaled
                rope_local = RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        attention_bias = bool(d.get("attention_bias", arch in ("SeedOssForCausalLM", "GptOssForCausalLM")))
        # GLM's and Helium's attention_bias: on q, k and v only
        o_bias = bool(d.get("attention_out_bias", False)) if arch == "SeedOssForCausalLM" else \
            attention_bias and arch not in ("Glm4ForCausalLM", "Glm4MoeForCausalLM", "HeliumForCausalLM",
                                            "SolarOpenForCausalLM")
        mlp_bias = bool(d.get("mlp_bias", False))
        if arch in ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"):  # one switch for every linear layer's bias
            attention_bias = o_bias = mlp_bias = bool(d.get("use_bias", False))
        num_experts = d.get("num_local_experts") or d.get("num_experts") or d.get("moe_num_experts") \
            or d.get("n_routed_experts") or 0
        dense_layers = ()
        shared = (d.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        if arch in ("GraniteMoeSharedForCausalLM", GRANITE_HYBRID, GRANITE_MOE_SWA):
            shared = d.get("shared_intermediate_size") or 0
        if arch == GRANITE_HYBRID:
            family = granite_hybrid(d, source)
        if arch == GRANITE_HYBRID and not num_experts:  # its shared MLP alone: a dense model
            d, shared = d | {"intermediate_size": shared}, 0
        if arch == "HunYuanMoEV1ForCausalLM":  # its shared MLP as wide as an expert, as HF's
            num_experts, top_k = (same_each_layer(d, key, source) for key in ("num_experts", "moe_topk"))
            d = d | {"num_experts_per_tok": top_k}
            shared = d["intermediate_size"]
        if arch == "OlmoeForCausalLM" and d.get("clip_qkv") is not None:
            raise ValueError(f"{source}: OLMoE's clip_qkv={d['clip_qkv']} is not supported")
        if arch == "Ernie4_5_MoeForCausalLM":  # MoE layers: every interval-th from start to end
            start, end = d.get("moe_layer_start_index", 0), d.get("moe_layer_end_index", layers - 1)
            interval = d.get("moe_layer_interval", 1)
            dense_layers = tuple(i for i in range(layers) if not ((i + 1) % interval == 0 and start <= i <= end))
            shared = d.get("moe_num_shared_experts", 0) * d["moe_intermediate_size"]
        if arch in ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"):  # a gated shared expert beside the experts
            shared = d.get("shared_expert_intermediate_size") or 0
        if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM"):
            step = d.get("decoder_sparse_step", 1) or 1
            dense_layers = tuple(i for i in range(layers)
                                 if i in (d.get("mlp_only_layers") or ()) or (i + 1) % step != 0)
        nope_layers = ()
        if arch in ("SmolLM3ForCausalLM", "Llama4ForCausalLM"):
            nope_layers = tuple(i for i, r in enumerate(uses_rope) if not r)
        llama4_fields = {}
        if llama4:  # dense layers intermediate_size_mlp wide, experts intermediate_size; a shared expert beside
            moe_layers = d.get("moe_layers")
            step = d.get("interleave_moe_layer_step") or 1
            moe_layers = range(step - 1, layers, step) if moe_layers is None else moe_layers
            dense_layers = tuple(i for i in range(layers) if i not in moe_layers)
            shared = d["intermediate_size"]
            llama4_fields = dict(
                attention_chunk=chunk, qk_l2_norm=bool(d.get("use_qk_norm", True)), router_weights_input=True,
                nope_temperature=(float(d.get("floor_scale", 8192)), float(d.get("attn_scale", 0.1)))
                if d.get("attn_temperature_tuning", True) else ())
        if arch == GRANITE_HYBRID and d.get("position_embedding_type") != "rope":  # Granite 4.0-H's: no rotary
            nope_layers = tuple(range(layers))
        if (arch in ("Exaone4ForCausalLM", EXAONE_MOE) and d.get("sliding_window") is not None) \
                or arch == "Cohere2ForCausalLM":
            nope_layers = tuple(i for i, t in enumerate(d.get("layer_types") or ()) if t == "full_attention")
        if arch in COHERE_FAMILY and d.get("use_qk_norm"):
            raise ValueError(f"{source}: Cohere's use_qk_norm=true (per-head LayerNorms) is not supported")
        scales = {k: float(d.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                                                    "attention_multiplier")} if arch in GRANITE_FAMILY else {}
        if arch == "MiniCPM3ForCausalLM":  # µP: the embedding, each block's output, the last hidden state scaled
            scales = {"embedding_multiplier": float(d.get("scale_emb", 12)),
                      "residual_multiplier": float(d.get("scale_depth", 1.4)) / math.sqrt(layers),
                      "logits_scaling": d["hidden_size"] / (d.get("dim_model_base") or d["hidden_size"])}
        if arch in COHERE_FAMILY:  # logits * logit_scale, a power of two in Cohere's releases: exact as a divisor
            scales = {"logits_scaling": 1.0 / float(d.get("logit_scale", 0.0625))}
        v3_router = arch in GROUP_ROUTED and arch not in SOFTMAX_GROUP_ROUTED
        deepseek = group_router(d, source, arch) if arch in GROUP_ROUTED else {}
        if arch in DEEPSEEK_FAMILY:
            deepseek |= latent_attention(d, arch)
            head_dim = deepseek["qk_rope_head_dim"] + d.get("qk_nope_head_dim", 128)
        if arch in GROUP_ROUTED:  # Glm4MoeLite names each layer's MLP; the others count the first dense ones
            kinds = d.get("mlp_layer_types") or ["dense" if i < d.get("first_k_dense_replace", 0)
                                                 or i % d.get("moe_layer_freq", 1) else "sparse" for i in range(layers)]
            dense_layers = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
            shared = (d.get("n_shared_experts") or 0) * (d.get("moe_intermediate_size") or 0)
        hybrid_fields = dict(attention_output_gate=True, linear_heads_tiled=bool(d.get("linear_heads_tiled")),
                             linear_attention=tuple(d[k] for k in (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim"))) if hybrid else {}
        gpt_oss = dict(attention_sinks=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(d.get("swiglu_alpha", 1.702))) if arch == "GptOssForCausalLM" else {}
        return cls(arch, d["vocab_size"], d["hidden_size"], layers, heads,
                   d.get("num_key_value_heads") or heads, head_dim,
                   d.get("intermediate_size_mlp") or d["intermediate_size"] if llama4 else d["intermediate_size"],
                   d.get("max_position_embeddings", 2048), d.get("rms_norm_eps", d.get("layer_norm_eps", 1e-6)), rope,
                   **dict(tie_word_embeddings=d.get("tie_word_embeddings", is_gemma or arch in COHERE_FAMILY),
                   qkv_bias=attention_bias or arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"), o_bias=o_bias,
                   mlp_bias=mlp_bias,
                   sliding_window=window, eos_token_ids=eos_ids, layer_types=layer_types, rope_local=rope_local,
                   qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                                    "Exaone4ForCausalLM", EXAONE_MOE, "HunYuanDenseV1ForCausalLM",
                                    "HunYuanMoEV1ForCausalLM",
                                    "Dots1ForCausalLM", "ApertusForCausalLM") + ALL_HEADS_QK_NORM + HYBRID_FAMILY
                   or (arch == "Glm4MoeForCausalLM" and bool(d.get("use_qk_norm"))),
                   qk_norm_after_rope=arch in ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"),
                   hidden_act=act, query_pre_attn_scalar=d.get("query_pre_attn_scalar") if is_gemma else None,
                   attn_logit_softcapping=d.get("attn_logit_softcapping") if is_gemma else None,
                   final_logit_softcapping=d.get("final_logit_softcapping") if is_gemma else None,
                   num_experts=num_experts if arch in MOE_FAMILY else 0,
                   num_experts_per_tok=d.get("num_experts_per_tok") or d.get("moe_k") or int(llama4)
                   if arch in MOE_FAMILY else 0,
                   moe_intermediate_size=d.get("moe_intermediate_size") or d["intermediate_size"],
                   norm_topk_prob=arch in ("MixtralForCausalLM", "Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM",
                                           "HunYuanMoEV1ForCausalLM", "Qwen3_5MoeForCausalLM")
                   or bool(d.get("norm_topk_prob", arch in ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM",
                                                            "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                                                            "SolarOpenForCausalLM", MINICPM5_MOE))),
                   dense_layers=dense_layers, nope_layers=nope_layers,
                   shared_expert_intermediate_size=shared,
                   shared_expert_gated=arch in ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"),
                   router_selection_bias=arch in ("Ernie4_5_MoeForCausalLM", "MiniMaxM2ForCausalLM") or v3_router,
                   router_softmax_after_topk=arch in ("GptOssForCausalLM", "GraniteMoeForCausalLM",
                                                      "GraniteMoeSharedForCausalLM", GRANITE_HYBRID,
                                                      GRANITE_MOE_SWA),
                   qk_norm_per_head=arch not in ALL_HEADS_QK_NORM,
                   fp8_block=fp8_block, text_of=wrapper or "", **scales, **gpt_oss,
                   experts_in_out=llama4,
                   router_sigmoid=v3_router or arch in ("MiniMaxM2ForCausalLM", "Llama4ForCausalLM"), **deepseek,
                   **llama4_fields, **hybrid_fields) | family)
