"""Every model family written to GGUF the way llama.cpp's converter writes it (convert_hf_to_gguf.py: its names, row
orders, norm offsets, rotary tensors and metadata; Q8_0 linear weights), run straight from the .gguf file over two
stages, equals HF transformers on the same weights (the file's values, dequantized) token for token."""
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pipellm import LLM, SamplingParams
from tests.test_families import COMMON, NEMOTRON_H_SHAPE, SHORT, TOLERANCE, assert_matches_hf, hf_greedy
from tests.test_gguf import TOKENS, llama_cpp_permute, write_tokenizer
from tests.test_parity import NEW_TOKENS, PROMPTS

VOCAB = len(TOKENS)  # the GGUF tokenizer's vocabulary
BASE = COMMON | dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GGUF_PROMPTS = [[t % VOCAB for t in p] for p in PROMPTS]
# family -> GGUF general.architecture (llama.cpp writes Mixtral as "llama" with experts)
ARCH = {"llama3": "llama", "mixtral": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3moe", "gemma2": "gemma2",
        "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3", "granite": "granite", "olmo2": "olmo2",
        "olmo3": "olmo2", "qwen2moe": "qwen2moe", "gemma": "gemma", "gpt_oss": "gpt-oss", "exaone4": "exaone4",
        "seed_oss": "seed_oss", "glm4": "glm4", "ernie4_5": "ernie4_5", "cohere": "command-r", "cohere2": "cohere2",
        "ernie4_5_moe": "ernie4_5-moe", "granitemoe": "granitemoe", "olmoe": "olmoe", "hunyuan": "hunyuan-dense",
        "arcee": "arcee", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe",
        "dots1": "dots1", "minimax_m2": "minimax-m2", "llama4": "llama4", "ministral3": "mistral3",
        "mistral4": "mistral4", "qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe",
        "qwen3_next-ssm_in": "qwen3next",  # as older converters wrote it: in_proj_qkvz whole
        "granitemoehybrid": "granitehybrid", "granitemoehybrid-dense": "granitehybrid",
        "nemotron_h": "nemotron_h_moe", "nemotron_h-dense": "nemotron_h", "nemotron_h-latent": "nemotron_h_moe",
        "falcon_h1": "falcon-h1", "falcon_h1-ungated": "falcon-h1", "jamba": "jamba", "lfm2": "lfm2",
        "lfm2_moe": "lfm2moe", "bamba": "granitehybrid",  # Bamba's: with rotary on half of each head
        "gpt_neox": "gptneox", "gpt_neox-sequential": "gptneox", "phi": "phi2", "phi-qkv": "phi2",
        "starcoder2": "starcoder2", "nemotron": "nemotron", "stablelm": "stablelm", "stablelm-parallel": "stablelm",
        "gemma4": "gemma4", "gemma4_moe": "gemma4", "exaone_moe": "exaone-moe"}
GEMMA4 = ("gemma4", "gemma4_moe")
CLASSIC = ("gpt_neox", "gpt_neox-sequential", "phi", "phi-qkv", "starcoder2", "nemotron", "stablelm",
           "stablelm-parallel")
GRANITE_HYBRID = ("granitemoehybrid", "granitemoehybrid-dense")
NEMOTRON_H = ("nemotron_h", "nemotron_h-dense", "nemotron_h-latent")
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_next-ssm_in")  # linear-attention layers
# the converter's LlamaModel: Q/K rows in llama.cpp's rotary order
PERMUTED = ("llama", "smollm3", "granite", "granitemoe", "arcee", "mistral3", "granitehybrid", "nemotron_h",
            "nemotron_h_moe")
FAMILIES = list(ARCH)

# HF module -> llama.cpp tensor kind (gguf-py's tensor_mapping.py), per family where it differs
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.gate": "ffn_gate_inp", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
              "mlp.shared_experts.down_proj": "ffn_down_shexp", "block_sparse_moe.router": "ffn_gate_inp",
              "self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm"}
GEMMA_TO_GGUF = HF_TO_GGUF | {"pre_feedforward_layernorm": "ffn_norm",
                              "post_attention_layernorm": "post_attention_norm",
                              "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA4_TO_GGUF = GEMMA_TO_GGUF | {"router.proj": "ffn_gate_inp", "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
                                  "post_feedforward_layernorm_1": "post_ffw_norm_1",
                                  "post_feedforward_layernorm_2": "post_ffw_norm_2"}
# Gemma 4's layer output scale, its router's scales (vectors, F32) and its stacked experts
GEMMA4_OWN = {"layer_scalar": "layer_output_scale.weight", "router.scale": "ffn_gate_inp.scale",
              "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
              "experts.down_proj": "ffn_down_exps.weight"}
PHI3_TO_GGUF = HF_TO_GGUF | {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
OLMO_TO_GGUF = HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm",
                             "post_feedforward_layernorm": "post_ffw_norm"}
GPT_OSS_TO_GGUF = HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
SEED_OSS_TO_GGUF = HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm"}  # no ffn_norm in its arch
GLM4_TO_GGUF = HF_TO_GGUF | {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
                             "mlp.gate_up_proj": "ffn_up"}
DEEPSEEK_TO_GGUF = HF_TO_GGUF | {"self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                                "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                                "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b"}
GLM4_MOE_TO_GGUF = HF_TO_GGUF | {"post_attention_layernorm": "post_attention_norm"}  # the norm before the MLP
LLAMA4_TO_GGUF = HF_TO_GGUF | {f"feed_forward.{k}": v for k, v in (
    ("router", "ffn_gate_inp"), ("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down"),
    ("shared_expert.gate_proj", "ffn_gate_shexp"), ("shared_expert.up_proj", "ffn_up_shexp"),
    ("shared_expert.down_proj", "ffn_down_shexp"))}
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
           moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
           topk_group=2, first_k_dense_replace=1)
GLOBAL_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight", "model.embeddings.weight": "token_embd.weight",
                  "model.norm_f.weight": "output_norm.weight", "model.final_layernorm.weight": "output_norm.weight",
                  "model.embedding_norm.weight": "token_embd_norm.weight",  # LFM2's last norm
                  "model.norm.bias": "output_norm.bias", "lm_head.bias": "output.bias",
                  "model.final_layernorm.bias": "output_norm.bias", "gpt_neox.embed_in.weight": "token_embd.weight",
                  "gpt_neox.final_layer_norm.weight": "output_norm.weight",
                  "gpt_neox.final_layer_norm.bias": "output_norm.bias", "embed_out.weight": "output.weight"}
FALCON_H1_TO_GGUF = HF_TO_GGUF | {f"feed_forward.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}
JAMBA_TO_GGUF = FALCON_H1_TO_GGUF | {
    "pre_ff_layernorm": "ffn_norm", "feed_forward.router": "ffn_gate_inp", "mamba.in_proj": "ssm_in",
    "mamba.x_proj": "ssm_x", "mamba.dt_proj": "ssm_dt", "mamba.out_proj": "ssm_out",
    "mamba.dt_layernorm": "ssm_dt_norm", "mamba.b_layernorm": "ssm_b_norm", "mamba.c_layernorm": "ssm_c_norm"}
LFM2_TO_GGUF = HF_TO_GGUF | {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
                             "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
                             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
                             "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
                             "feed_forward.gate": "ffn_gate_inp"}
CLASSIC_TO_GGUF = HF_TO_GGUF | {"attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
                                "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
                                "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
                                "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
NEMOTRON_TO_GGUF = {"norm": "attn_norm", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k", "mixer.v_proj": "attn_v",
                    "mixer.o_proj": "attn_output", "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down",
                    "mixer.gate": "ffn_gate_inp", "mixer.shared_experts.up_proj": "ffn_up_shexp",
                    "mixer.shared_experts.down_proj": "ffn_down_shexp", "mixer.fc1_latent_proj": "ffn_latent_down",
                    "mixer.fc2_latent_proj": "ffn_latent_up"}


def gguf_family_config(name: str):
    """Tiny HF configs that llama.cpp can represent: Gemma's query scale = head_dim, its fixed sliding patterns
    (Gemma 2: even layers local; Gemma 3: every 6th layer global, local base 10000); Qwen3-MoE renormalising top-k."""
    import transformers as tf

    if name == "llama3":
        return tf.LlamaConfig(**BASE, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if name == "mixtral":
        return tf.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3":  # head_dim 32, not hidden / heads = 16; q/k norms
        return tf.Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=False)
    if name == "qwen3moe":
        return tf.Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 norm_topk_prob=True)
    if name == "gemma2":  # PROMPTS[2] (40 tokens) goes past the window
        return tf.Gemma2Config(**BASE, head_dim=16, sliding_window=24, query_pre_attn_scalar=16,
                               attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if name == "gemma3":  # layers 0-4 local (base 10000), layer 5 global (base 1e6, linear x2)
        return tf.Gemma3TextConfig(**BASE | dict(num_hidden_layers=6), head_dim=32, sliding_window=24,
                                   query_pre_attn_scalar=32, final_logit_softcapping=15.0,
                                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                    "full_attention": dict(rope_type="linear", rope_theta=1e6,
                                                                           factor=2.0)})
    if name == "phi3":  # partial rotary: 8 of 16 dims turn; long factors once past SHORT
        rotated_half = 16 // 2 // 2
        return tf.Phi3Config(**BASE, original_max_position_embeddings=SHORT, partial_rotary_factor=0.5,
                             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                  original_max_position_embeddings=SHORT,
                                                  short_factor=[1.0 + 0.1 * i for i in range(rotated_half)],
                                                  long_factor=[2.0 + 0.5 * i for i in range(rotated_half)]))
    if name == "gemma":  # Gemma 1: Llama's order, Gemma's norms (stored as 1 + w)
        return tf.GemmaConfig(**BASE, head_dim=32)
    if name == "exaone_moe":  # EXAONE 4's attention before Llama's norms, sliding layers; DeepSeek V3's experts after
        # a dense layer (no groups: its converter writes none)
        return tf.ExaoneMoeConfig(**BASE | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                                  num_experts=8, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                                  routed_scaling_factor=1.5, sliding_window=24, layer_types=[
                                      "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                      "full_attention"])
    if name in GEMMA4:  # full layers 1 and 4: heads of 32, their values their keys' projection (one KV head) or
        # their own (MoE: two), rotary on a quarter of each; sliding layers: two KV heads of 16
        moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        return tf.Gemma4TextConfig(**BASE, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=0,
                                   sliding_window=24, final_logit_softcapping=15.0, layer_types=[
                                       "sliding_attention", "full_attention", "sliding_attention",
                                       "sliding_attention", "full_attention"],
                                   **(moe if name == "gemma4_moe" else dict(attention_k_eq_v=True,
                                                                            num_global_key_value_heads=1)))
    if name == "qwen2moe":  # a shared expert; llama.cpp never renormalises the chosen experts' weights
        return tf.Qwen2MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 shared_expert_intermediate_size=96, norm_topk_prob=False)
    if name == "smollm3":  # layer 3 without rotary (llama.cpp: every 4th)
        return tf.SmolLM3Config(**BASE)
    if name == "granite":
        return tf.GraniteConfig(**BASE, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                logits_scaling=2.0)
    if name == "olmo2":
        return tf.Olmo2Config(**BASE)
    if name == "olmo3":  # sliding layers; one rotary for both kinds, as the file holds one
        return tf.Olmo3Config(**BASE, sliding_window=24, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"])
    if name == "exaone4":  # norms after attention and MLP; full layers without rotary; llama3's rope as rope_freqs
        return tf.Exaone4Config(**BASE, sliding_window=24, layer_types=[
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64))
    if name == "seed_oss":  # q/k/v biases, and one on the attention's output
        return tf.SeedOssConfig(**BASE, head_dim=32, attention_bias=True, attention_out_bias=True)
    if name == "glm4":  # rotary on half of each head, its pairs interleaved; gate and up fused
        return tf.Glm4Config(**BASE, head_dim=32, partial_rotary_factor=0.5)
    if name == "ernie4_5":  # rotary pairs interleaved over the whole head
        return tf.Ernie4_5Config(**BASE, head_dim=16)
    if name == "ernie4_5_moe":  # experts picked with a bias, a shared expert; layer 0 dense (llama.cpp: an interval
        # of 1 only)
        return tf.Ernie4_5_MoeConfig(**BASE, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=48,
                                     moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1)
    if name == "granitemoe":  # Granite's multipliers; experts split into gate and up, as the converter does
        return tf.GraniteMoeConfig(**BASE | dict(intermediate_size=48), num_local_experts=4, num_experts_per_tok=2,
                                   embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                   logits_scaling=2.0)
    if name == "olmoe":  # q/k norms over all heads (llama.cpp: as many KV heads as query heads); no renormalising
        return tf.OlmoeConfig(**BASE | dict(intermediate_size=48, num_key_value_heads=4), num_experts=4,
                              num_experts_per_tok=2)
    if name == "hunyuan":  # q/k norms after rotary; the converter writes the base NTK alpha stretched
        return tf.HunYuanDenseV1Config(**BASE, head_dim=16, rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0))
    if name == "arcee":  # an ungated relu(x)**2 MLP; yarn, as llama.cpp computes it (its ramp's ends rounded)
        return tf.ArceeConfig(**BASE | dict(max_position_embeddings=SHORT * 8), rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=SHORT))
    if name == "cohere":  # a LayerNorm, attention and MLP side by side; logits scaled
        return tf.CohereConfig(**BASE, logit_scale=0.25)
    if name == "cohere2":  # and llama.cpp's fixed pattern: every 4th layer full, without rotary
        return tf.Cohere2Config(**BASE, logit_scale=0.25, sliding_window=24, layer_types=[
            "sliding_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    if name == "gpt_oss":  # sinks, experts in MXFP4; llama.cpp's yarn truncates its ramp's ends, as HF's truncate=True
        return tf.GptOssConfig(**BASE, head_dim=16, sliding_window=24, num_local_experts=4, num_experts_per_tok=2,
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                                    beta_slow=1.0, original_max_position_embeddings=SHORT,
                                                    truncate=True))
    if name == "deepseek_v2":  # kv_b whole (older converters), one q_proj, softmax routing in groups; DeepSeek's yarn
        return tf.DeepseekV2Config(**BASE | MLA | dict(max_position_embeddings=SHORT * 8), q_lora_rank=None,
                                   topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                                        mscale=0.707, mscale_all_dim=0.707,
                                                        original_max_position_embeddings=SHORT))
    if name == "deepseek_v3":  # kv_b split into each head's k_b and v_b (newer converters); sigmoid routing
        return tf.DeepseekV3Config(**BASE | MLA, q_lora_rank=48, routed_scaling_factor=2.5)
    if name == "glm4_moe":  # q/k norms and biases, rotary on half of each head; DeepSeek V3's experts; an MTP layer
        return tf.Glm4MoeConfig(**BASE | dict(intermediate_size=48), head_dim=16, attention_bias=True,
                                use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    if name == "dots1":  # Qwen3's attention, DeepSeek V3's experts in groups
        return tf.Dots1Config(**BASE | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=1, routed_scaling_factor=1.5, norm_topk_prob=True)
    if name == "minimax_m2":  # q/k norms over all heads, rotary on half of each head; a sigmoid router's bias
        return tf.MiniMaxM2Config(**BASE | dict(intermediate_size=32), head_dim=16, num_local_experts=8,
                                  num_experts_per_tok=2, rotary_dim=8)
    if name == "llama4":  # llama.cpp's fixed chunks (8192) and temperature (0.1 past 8192); experts every other
        # layer; llama3's rope as rope_freqs
        return tf.Llama4TextConfig(**BASE | dict(intermediate_size=32), head_dim=16, intermediate_size_mlp=96,
                                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                   attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, rope_parameters=dict(
                                       rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=64))
    if name == "ministral3":  # yarn (its ramp's ends, dims 1 and 3, from the file's betas), and Llama 4's
        # temperature on q past SHORT tokens
        return tf.Ministral3Config(**BASE | dict(max_position_embeddings=SHORT * 8), head_dim=16,
                                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                                        original_max_position_embeddings=SHORT, beta_fast=1.0,
                                                        beta_slow=0.5, mscale=1.0, mscale_all_dim=1.0,
                                                        llama_4_scaling_beta=0.1))
    if name == "mistral4":  # DeepSeek V3's file with a softmax router, experts' gate and up fused; the temperature
        return tf.Mistral4Config(**BASE | MLA | dict(max_position_embeddings=SHORT * 8), q_lora_rank=48,
                                 routed_scaling_factor=1.5, rope_parameters=dict(
                                     rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                     original_max_position_embeddings=SHORT, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                     mscale_all_dim=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=8 / 24))
    if name in GRANITE_HYBRID:  # Mamba-2 layers in 2 groups but layer 2; without rotary, as the converter takes every
        # hybrid Granite to be
        return tf.GraniteMoeHybridConfig(**BASE | dict(intermediate_size=32), shared_intermediate_size=64,
                                         num_local_experts=0 if name.endswith("-dense") else 4, num_experts_per_tok=2,
                                         layer_types=["mamba", "mamba", "attention", "mamba", "mamba"],
                                         mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                                         position_embedding_type=None, embedding_multiplier=4.0,
                                         residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
    if name in NEMOTRON_H:  # Mamba-2 (8 heads of 12 in 2 groups), attention without rotary, and relu^2 MLPs or
        # experts (llama.cpp's files cannot tell an MLP layer in an experts model), on a projection (-latent)
        mlp = "mlp" if name.endswith("-dense") else "moe"
        return tf.NemotronHConfig(**BASE, **NEMOTRON_H_SHAPE, layers_block_type=[
            "linear_attention", mlp, "full_attention", mlp, "linear_attention"],
            moe_latent_size=32 if name.endswith("-latent") else None, moe_shared_expert_intermediate_size=64)
    if name == "bamba":  # Granite 4.0-H's Mamba-2 layers (8 heads in 2 groups) but layer 2, attention with rotary on
        # half of each head
        return tf.BambaConfig(**BASE, attn_layer_indices=[2], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
                              mamba_d_conv=4)
    if name == "lfm2":  # short convolutions but layers 1 and 4; the MLP's width adjusted (to 64)
        return tf.Lfm2Config(**BASE, full_attn_idxs=[1, 4], block_multiple_of=16)
    if name == "lfm2_moe":  # and experts from layer 1 (llama.cpp's: renormalised, unscaled)
        return tf.Lfm2MoeConfig(**BASE, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                                num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if name == "jamba":  # Mamba but layer 2 (attention, every 4th from it); experts in layers 1 and 3
        return tf.JambaConfig(**BASE, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                              mamba_dt_rank=6)
    if name.startswith("falcon_h1"):  # attention and Mamba-2 side by side, its norm after the gate (llama.cpp's only
        # order) or none (-ungated); multipliers 1: the converter folds them into the weights
        return tf.FalconH1Config(**BASE, mamba_d_ssm=96, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
                                 mamba_rms_norm=name == "falcon_h1", mamba_norm_before_gate=False)
    if name.startswith("gpt_neox"):  # a quarter of each head rotated; attention and MLP side by side, or in turn
        return tf.GPTNeoXConfig(**{k: v for k, v in BASE.items() if k != "num_key_value_heads"}, hidden_act="gelu",
                                use_parallel_residual=name == "gpt_neox",
                                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                     partial_rotary_factor=0.25))
    if name.startswith("phi"):  # its converter writes as many KV heads as heads; half of each head rotated
        return tf.PhiConfig(**BASE | dict(num_key_value_heads=4))
    if name == "starcoder2":  # no window: llama.cpp reads none for it
        return tf.Starcoder2Config(**BASE, sliding_window=None)
    if name == "nemotron":  # 1 + w LayerNorms, stored as such; relu^2; half of each head rotated
        return tf.NemotronConfig(**BASE)
    if name.startswith("stablelm"):  # q/k/v biases and one norm a layer (-parallel: its layers without ffn_norm)
        return tf.StableLmConfig(**BASE, use_qkv_bias=name == "stablelm-parallel",
                                 use_parallel_residual=name == "stablelm-parallel")
    if name in HYBRID:  # two value heads a key head (which qwen35 files tile); llama.cpp's: key and value heads as
        # wide, every 4th layer full, a quarter of each head rotated, experts in every layer
        linear = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
        if name.startswith("qwen3_next"):
            return tf.Qwen3NextConfig(**BASE, **linear, **moe)
        if name == "qwen3_5":
            return tf.Qwen3_5TextConfig(**BASE, **linear)
        return tf.Qwen3_5MoeTextConfig(**BASE, **linear, **moe)
    raise ValueError(name)


def _rope_parameters(cfg) -> dict:
    params = cfg.rope_parameters
    return params.get("full_attention", params)


def llama3_rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3: per default frequency, the divisor HF's llama3 rotary applies."""
    rope = _rope_parameters(cfg)
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_metadata(w: gguf.GGUFWriter, name: str, cfg) -> None:
    if name in NEMOTRON_H:
        return write_nemotron_h_metadata(w, cfg)
    if name in GEMMA4:  # its head_dim and num_key_value_heads: the sliding layers'
        cfg.allow_global_per_layer_attribute_access = True
    w.add_block_count(cfg.num_hidden_layers + (name == "glm4_moe"))  # and its MTP layer
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    # (LFM2's converter writes its MLPs' adjusted width)
    w.add_feed_forward_length(cfg.intermediate_size_mlp if name == "llama4" else 64 if name == "lfm2" else
                              4 * cfg.hidden_size if name.startswith("phi-") or name == "phi" else
                              cfg.intermediate_size)
    if name == "lfm2_moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_head_count(cfg.num_attention_heads)
    stateful = name in GRANITE_HYBRID + ("jamba", "lfm2", "lfm2_moe", "bamba")  # 0 KV heads: no attention
    types = cfg.layers_block_type if name == "bamba" else getattr(cfg, "layer_types", None)
    if name.startswith("gpt_neox"):  # its converter writes no KV heads
        pass
    elif name in GEMMA4:
        write_gemma4_metadata(w, cfg)
    else:
        w.add_head_count_kv([cfg.num_key_value_heads * (t == "full_attention") for t in types]
                            if stateful else cfg.num_key_value_heads)
    if name.startswith("lfm2"):
        w.add_layer_norm_rms_eps(cfg.norm_eps)
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    elif name.startswith("cohere"):
        w.add_layer_norm_eps(cfg.layer_norm_eps)
        w.add_logit_scale(cfg.logit_scale)
    elif name in CLASSIC:  # LayerNorms; rotary on part of each head
        w.add_layer_norm_eps(cfg.norm_epsilon if name == "starcoder2" else cfg.norm_eps if name == "nemotron" else
                             cfg.layer_norm_eps)
        rotated = _rope_parameters(cfg).get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(rotated * cfg.hidden_size) // cfg.num_attention_heads)
        if name.startswith(("gpt_neox", "stablelm")):
            w.add_parallel_residual(cfg.use_parallel_residual)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    head_dim = None if name in CLASSIC else getattr(cfg, "head_dim", None)
    if name.startswith("deepseek") or name == "mistral4":
        write_deepseek_metadata(w, name, cfg)
    elif head_dim is not None and name not in ("phi3",) + GEMMA4:  # written when the config names it
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if name == "hunyuan":
        rope = _rope_parameters(cfg)
        w.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    elif name not in ("gemma2", "jamba"):  # llama.cpp assumes Gemma 2's base, 10000; Jamba takes no rotary
        w.add_rope_freq_base(_rope_parameters(cfg)["rope_theta"])
    if name in ("llama3", "mixtral", "llama4", "ministral3"):
        w.add_rope_dimension_count(head_dim or cfg.hidden_size // cfg.num_attention_heads)
    if name == "llama4":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_interleave_moe_layer_step(cfg.interleave_moe_layer_step)
    if name == "ministral3":  # its converter: yarn's keys, mscale_all_dim as it is, the temperature's beta
        rope = _rope_parameters(cfg)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if name == "glm4":
        w.add_rope_dimension_count(int(head_dim * _rope_parameters(cfg)["partial_rotary_factor"]))
    if name == "olmoe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if name in ("mixtral", "gpt_oss", "granitemoe"):
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if name in ("gpt_oss", "arcee"):
        rope = _rope_parameters(cfg)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if name == "gpt_oss":
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
    if name == "ernie4_5_moe":  # the converter's shared width: intermediate_size // num_key_value_heads
        w.add_expert_count(cfg.moe_num_experts)
        w.add_expert_used_count(cfg.moe_k)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.intermediate_size // cfg.num_key_value_heads)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
    if name == "glm4_moe":
        w.add_rope_dimension_count(int(head_dim * _rope_parameters(cfg)["partial_rotary_factor"]))
        w.add_nextn_predict_layers(1)
    if name in ("glm4_moe", "dots1"):
        write_group_routed_metadata(w, cfg, sigmoid=True)
    if name == "minimax_m2":  # its converter: the rotated width from rotary_dim; no weights' norm or scale keys
        w.add_rope_dimension_count(cfg.rotary_dim)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if name in HYBRID:  # the converter's: the interval and the rotated quarter as fixed values
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
        w.add_full_attention_interval(4)
        w.add_rope_dimension_count(int(head_dim * 0.25))
    if name in ("qwen3_5", "qwen3_5_moe"):  # its multimodal rotary's sections, written whatever they are
        w.add_rope_dimension_sections(list(_rope_parameters(cfg).get("mrope_section", [11, 11, 10])) + [0])
    if name in ("qwen3_next", "qwen3_5_moe", "qwen3_next-ssm_in"):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if name in ("qwen3moe", "qwen2moe", "qwen3_next", "qwen3_5_moe", "qwen3_next-ssm_in"):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if name == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if name == "exaone_moe":  # its converter's: no groups, no gating function (llama.cpp's: sigmoid)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.num_shared_experts)
        w.add_expert_shared_feed_forward_length(cfg.moe_intermediate_size * cfg.num_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_leading_dense_block_count(1)
        w.add_nextn_predict_layers(0)
    if name == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if name == "gemma3":
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)  # global layers only
        w.add_rope_scaling_factor(_rope_parameters(cfg)["factor"])
    if name in GRANITE_HYBRID:  # Mamba-2's keys; no rotary (its switch), and a context of 2**20 for it
        w.add_context_length(2 ** 20)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_rope_scaling_finetuned(False)
        write_ssm(w, cfg.mamba_d_conv, cfg.mamba_d_state, cfg.mamba_n_heads, cfg.mamba_expand * cfg.hidden_size,
                  cfg.mamba_n_groups)
    if name == "bamba":  # rotary on: the converter's switch for Bamba; the rotated half
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads // 2)
        w.add_rope_scaling_finetuned(True)
        write_ssm(w, cfg.mamba_d_conv, cfg.mamba_d_state, cfg.mamba_n_heads, cfg.mamba_expand * cfg.hidden_size,
                  cfg.mamba_n_groups)
    if name == "jamba":  # its time step rank: dt's
        write_ssm(w, cfg.mamba_d_conv, cfg.mamba_d_state, cfg.mamba_dt_rank, cfg.mamba_expand * cfg.hidden_size)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if name.startswith("falcon_h1"):
        write_ssm(w, cfg.mamba_d_conv, cfg.mamba_d_state, cfg.mamba_n_heads, cfg.mamba_d_ssm, cfg.mamba_n_groups)
    if name in GRANITE_HYBRID:
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if name in ("granite", "granitemoe") + GRANITE_HYBRID:  # the converter renames the multipliers to scales
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if name in ("olmo3", "exaone4", "cohere2", "exaone_moe"):
        w.add_sliding_window(cfg.sliding_window)
    if name in ("olmo3", "exaone4", "exaone_moe"):  # cohere2's converter writes no pattern
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if name == "phi3":
        rope = _rope_parameters(cfg)
        original = rope["original_max_position_embeddings"]
        w.add_rope_dimension_count(int(cfg.partial_rotary_factor * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_sliding_window(cfg.sliding_window or 0)  # 0: none (Phi-4 has none either)
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def write_gemma4_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """As the converter's Gemma4Model: the full layers' head width as key_length, the sliding ones' as
    key_length_swa; KV heads per layer where the config names the full layers' own; the sliding pattern."""
    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    full = cfg.per_layer_config[cfg.layer_types.index("full_attention")]
    w.add_head_count_kv([cfg.num_key_value_heads if s else full.num_key_value_heads for s in sliding]
                        if full.num_key_value_heads != cfg.num_key_value_heads else cfg.num_key_value_heads)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(cfg.head_dim)
    w.add_value_length_swa(cfg.head_dim)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(cfg.head_dim)
    if cfg.enable_moe_block:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.top_k_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def gemma4_rope_freqs(cfg) -> np.ndarray:
    """The converter's rope_freqs for Gemma 4's full layers: 1 for each pair its proportional rotary turns, 1e30 (no
    turn) for the others."""
    width = cfg.per_layer_config[cfg.layer_types.index("full_attention")].head_dim
    turning = int(width * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turning + [1e30] * (width // 2 - turning), dtype=np.float32)


def write_ssm(w: gguf.GGUFWriter, kernel: int, state: int, rank: int, inner: int, groups: int | None = None) -> None:
    """The converter's Mamba keys: its time step rank is Mamba-2's heads (Jamba's: dt's rank)."""
    w.add_ssm_conv_kernel(kernel)
    w.add_ssm_state_size(state)
    w.add_ssm_time_step_rank(rank)
    w.add_ssm_inner_size(inner)
    if groups is not None:
        w.add_ssm_group_count(groups)


def write_nemotron_h_metadata(w: gguf.GGUFWriter, cfg) -> None:
    """nemotron_h(_moe) as its converter writes it: per layer its KV heads and MLP width (0 where it has none), a
    context of 2**20, a meaningless rotary width, no RMS epsilon key (where the config has no rms_norm_eps); the
    newest converter's MTP layer after the last (an attention and experts layer)."""
    moe = "moe" in cfg.layers_block_type
    types = cfg.layers_block_type + ["mtp"] * moe
    w.add_block_count(len(types))
    w.add_context_length(2 ** 20)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length([(cfg.moe_intermediate_size if moe else cfg.intermediate_size) *
                               (t in ("mlp", "moe", "mtp")) for t in types])
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads * (t in ("full_attention", "mtp")) for t in types])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_scaling_finetuned(False)
    write_ssm(w, cfg.conv_kernel, cfg.ssm_state_size, cfg.mamba_num_heads, cfg.mamba_num_heads * cfg.mamba_head_dim,
              cfg.n_groups)
    if moe:
        w.add_expert_count(cfg.n_routed_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_norm(cfg.norm_topk_prob)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_nextn_predict_layers(1)
        if cfg.moe_latent_size:
            w.add_uint32(f"{w.arch}.moe_latent_size", cfg.moe_latent_size)


def write_group_routed_metadata(w: gguf.GGUFWriter, cfg, sigmoid: bool) -> None:
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:  # the converter writes it only when true
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)


def write_deepseek_metadata(w: gguf.GGUFWriter, name: str, cfg) -> None:
    """deepseek2: V3's file as newer converters write it (one KV head of the latent and rotary key, the MLA widths
    apart), V2's as older ones did (key and value widths per head); yarn's mscale_all_dim as 0.1 times it."""
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if name in ("deepseek_v3", "mistral4"):
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(cfg.v_head_dim)
        w.add_q_lora_rank(cfg.q_lora_rank)
    else:
        w.add_key_length(qk)
        w.add_value_length(cfg.v_head_dim)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    write_group_routed_metadata(w, cfg, sigmoid=name == "deepseek_v3")
    rope = _rope_parameters(cfg)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if rope.get("llama_4_scaling_beta"):  # as llama.cpp's deepseek2 loader reads it (Mistral Large's converter)
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
        w.add_attn_temperature_length(rope["original_max_position_embeddings"])


def _row_order(rows: int, n_head: int) -> np.ndarray:
    # llama.cpp's stored row r holds HF row order[r]
    return llama_cpp_permute(np.arange(rows)[:, None], n_head)[:, 0]


def write_family_gguf(path, name: str, model, edit=None) -> dict:
    """Writes the HF model as llama.cpp's converter would, linear weights Q8_0 where a row splits into 32-wide
    blocks (else F32), norms and routers F32. Returns the HF state dict of what the file holds (dequantized, the
    converter's changes undone), for the reference. edit(writer) may add metadata."""
    cfg, arch = model.config, ARCH[name]
    names = {"gemma2": GEMMA_TO_GGUF, "gemma3": GEMMA_TO_GGUF, "phi3": PHI3_TO_GGUF, "olmo2": OLMO_TO_GGUF,
             "olmo3": OLMO_TO_GGUF, "gpt_oss": GPT_OSS_TO_GGUF, "exaone4": OLMO_TO_GGUF,
             "seed_oss": SEED_OSS_TO_GGUF, "glm4": GLM4_TO_GGUF, "deepseek_v2": DEEPSEEK_TO_GGUF,
             "deepseek_v3": DEEPSEEK_TO_GGUF, "glm4_moe": GLM4_MOE_TO_GGUF, "mistral4": DEEPSEEK_TO_GGUF,
             "llama4": LLAMA4_TO_GGUF, **dict.fromkeys(HYBRID, SEED_OSS_TO_GGUF), "falcon_h1": FALCON_H1_TO_GGUF,
             "falcon_h1-ungated": FALCON_H1_TO_GGUF, "jamba": JAMBA_TO_GGUF, "lfm2": LFM2_TO_GGUF,
             "lfm2_moe": LFM2_TO_GGUF, "bamba": JAMBA_TO_GGUF, **dict.fromkeys(CLASSIC, CLASSIC_TO_GGUF),
             **dict.fromkeys(GEMMA4, GEMMA4_TO_GGUF)}.get(
                 name, HF_TO_GGUF)
    w = gguf.GGUFWriter(str(path), arch)
    write_metadata(w, name, cfg)
    write_tokenizer(w)
    if edit:
        edit(w)

    def add(gname: str, arr: np.ndarray, router: bool = False, qtype=None) -> np.ndarray:
        """Writes one tensor; returns the values the file holds."""
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        qtype = qtype or (Q.Q8_0 if arr.ndim >= 2 and arr.shape[-1] % 32 == 0 and not router else Q.F32)
        data = gguf.quants.quantize(arr, qtype)
        w.add_tensor(gname, data, raw_dtype=None if qtype == Q.F32 else qtype)
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(arr.shape)

    if name in ("llama3", "exaone4", "llama4"):
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    if name in GEMMA4:
        w.add_tensor("rope_freqs.weight", gemma4_rope_freqs(cfg))
    if name == "phi3":
        rope = _rope_parameters(cfg)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    held = {}
    state = model.state_dict()
    for hf, tensor in state.items():
        arr = tensor.numpy()
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the converter writes the embedding once
        if hf in GLOBAL_TO_GGUF:
            gname = GLOBAL_TO_GGUF[hf]
        else:
            _, _, layer, rest = hf.split(".", 3)
            if name in GEMMA4 and rest in GEMMA4_OWN:  # the converter's names of Gemma 4's own tensors
                held[hf] = add(f"blk.{layer}.{GEMMA4_OWN[rest]}", arr, router=not rest.startswith("experts"))
                continue
            module, suffix = rest.rsplit(".", 1)
            if suffix == "e_score_correction_bias":  # ERNIE's [1, E], DeepSeek's and GLM's [E]
                held[hf] = add(f"blk.{layer}.exp_probs_b.bias", arr, router=True)
                continue
            if module == "self_attn.kv_b_proj" and name in ("deepseek_v3", "mistral4"):  # each head's k_b
                # transposed, and v_b
                heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
                per_head = arr.reshape(heads, -1, arr.shape[1])                           # [H, nope + v, rank]
                k_b = add(f"blk.{layer}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1))
                v_b = add(f"blk.{layer}.attn_v_b.weight", per_head[:, nope:])
                held[hf] = np.concatenate([k_b.transpose(0, 2, 1), v_b], 1).reshape(arr.shape)
                continue
            if module.startswith(("mamba", "shared_mlp")) and name in GRANITE_HYBRID + ("bamba",):
                held[hf] = _add_granite_hybrid(add, f"blk.{layer}.", module, suffix, arr, cfg)
                continue
            if name.startswith("falcon_h1") and module == "pre_ff_layernorm":  # its name without .weight
                held[hf] = add(f"blk.{layer}.ffn_norm", arr)
                continue
            if name == "jamba" and (suffix in ("A_log", "D") or module == "mamba.conv1d"):
                held[hf] = _add_jamba_mamba(add, f"blk.{layer}.", suffix, arr)
                continue
            if name.startswith("lfm2") and suffix == "expert_bias":  # a buffer, without .weight
                held[hf] = add(f"blk.{layer}.exp_probs_b.bias", arr, router=True)
                continue
            if name.startswith("lfm2") and module == "conv.conv":  # the converter squeezes it to [C, taps]
                held[hf] = add(f"blk.{layer}.shortconv.conv.{suffix}", arr[:, 0])[:, None]
                continue
            if name.startswith("falcon_h1") and module.startswith("mamba"):
                held[hf] = _add_granite_hybrid(add, f"blk.{layer}.", module, suffix, arr, cfg)
                continue
            if name in NEMOTRON_H and module == "mixer.experts":  # stacked [E, ...], as HF holds them
                held[hf] = add(f"blk.{layer}.ffn_{suffix.removesuffix('_proj')}_exps.weight", arr)
                continue
            if name in NEMOTRON_H and module not in NEMOTRON_TO_GGUF:  # a Mamba-2 layer's
                held[hf] = _add_granite_hybrid(add, f"blk.{layer}.", module.replace("mixer", "mamba"), suffix, arr,
                                               cfg)
                continue
            if module.startswith("linear_attn"):
                held[hf] = _add_linear_attention(add, f"blk.{layer}.", module, suffix, arr, cfg,
                                                 tiled=not name.startswith("qwen3_next"),
                                                 whole_qkvz=name == "qwen3_next-ssm_in")
                continue
            if module == "attention.query_key_value":  # its converter's rows: all q's, all k's, all v's
                heads = cfg.num_attention_heads
                by_head = arr.reshape(heads, 3, -1, *arr.shape[1:])              # [H, 3, D, ...]
                stored = add(f"blk.{layer}.attn_qkv.{suffix}", np.swapaxes(by_head, 0, 1).reshape(arr.shape))
                held[hf] = np.swapaxes(stored.reshape(3, heads, *by_head.shape[2:]), 0, 1).reshape(arr.shape)
                continue
            if name == "phi-qkv" and module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                if module == "self_attn.q_proj":  # older converters': q, k and v in one tensor
                    parts = [state[hf.replace("q_proj", p)].numpy() for p in ("q_proj", "k_proj", "v_proj")]
                    stored = np.split(add(f"blk.{layer}.attn_qkv.{suffix}", np.concatenate(parts)),
                                      np.cumsum([len(p) for p in parts])[:2])
                    for p, part in zip(("q_proj", "k_proj", "v_proj"), stored):
                        held[hf.replace("q_proj", p)] = part
                continue
            if name == "gpt_oss" and module in ("mlp.experts", "self_attn") and suffix != "o_proj":
                held[hf] = _add_gpt_oss(add, f"blk.{layer}.", suffix, arr)
                continue
            if module in ("mlp.experts", "block_sparse_moe.experts", "feed_forward.experts"):  # stacked [E, ...]
                # (HF fuses gate and up; llama.cpp keeps three, but Mistral 4's; Llama 4's [E, in, out] transposed)
                prefix = f"blk.{layer}."
                if name == "llama4":
                    held[hf] = _add_llama4_experts(add, prefix, suffix, arr)
                elif name == "mistral4" and suffix == "gate_up_proj":
                    held[hf] = add(prefix + "ffn_gate_up_exps.weight", arr)
                elif suffix == "gate_up_proj":
                    ff = arr.shape[1] // 2
                    held[hf] = np.concatenate([add(prefix + "ffn_gate_exps.weight", arr[:, :ff]),
                                               add(prefix + "ffn_up_exps.weight", arr[:, ff:])], axis=1)
                else:
                    assert suffix == "down_proj", hf
                    held[hf] = add(prefix + "ffn_down_exps.weight", arr)
                continue
            gname = f"blk.{layer}.{(NEMOTRON_TO_GGUF if name in NEMOTRON_H else names)[module]}.{suffix}"
        kind = gname.split(".")[-2]
        if arch in PERMUTED and kind in ("attn_q", "attn_k"):  # rotary pairs interleaved per head
            order = _row_order(arr.shape[0], cfg.num_attention_heads if kind == "attn_q" else
                               cfg.num_key_value_heads)
            stored = add(gname, arr[order])
            held[hf] = np.empty_like(stored)
            held[hf][order] = stored
        elif kind == "ffn_gate_inp_shexp":  # llama.cpp's is a vector, HF's one row
            held[hf] = add(gname, arr[0])[None]
        elif (arch in ("gemma", "gemma2", "gemma3") or name in HYBRID + ("nemotron",)) \
                and gname.endswith("norm.weight"):  # their norms: 1 + w (Gemma 4's as they are)
            held[hf] = add(gname, arr + np.float32(1)) - np.float32(1)
        else:
            held[hf] = add(gname, arr, router=kind == "ffn_gate_inp")
    if name in ("glm4_moe", "nemotron_h"):  # the MTP layer after the last, which inference leaves unread
        mtp = f"blk.{cfg.num_hidden_layers}."
        add(mtp + "nextn.eh_proj.weight", np.ones((cfg.hidden_size, 2 * cfg.hidden_size)))
        add(mtp + "attn_norm.weight", np.ones(cfg.hidden_size))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cfg.tie_word_embeddings:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    return {k: torch.from_numpy(v) for k, v in held.items()}


def _add_granite_hybrid(add, prefix: str, module: str, suffix: str, arr: np.ndarray, cfg) -> np.ndarray:
    """A Granite 4.0-H Mamba-2 layer's or shared MLP's tensor as the converter writes it: the conv squeezed, A_log as
    -exp(A_log) and D each [heads, 1], the norm [groups, width / groups], all F32; the shared MLP's gate and up
    apart (a dense model's as its MLP). Returns HF's tensor of what the file holds."""
    if module == "shared_mlp.input_linear":
        half, kind = arr.shape[0] // 2, "_shexp" if cfg.num_local_experts else ""
        return np.concatenate([add(f"{prefix}ffn_gate{kind}.weight", arr[:half]),
                               add(f"{prefix}ffn_up{kind}.weight", arr[half:])])
    if module == "shared_mlp.output_linear":
        return add(f"{prefix}ffn_down{'_shexp' if cfg.num_local_experts else ''}.weight", arr)
    if suffix == "A_log":
        return np.log(-add(prefix + "ssm_a", -np.exp(arr)[:, None]))[:, 0]
    if suffix == "D":
        return add(prefix + "ssm_d", arr[:, None])[:, 0]
    if suffix == "dt_bias":
        return add(prefix + "ssm_dt.bias", arr)
    if module == "mamba.conv1d":
        return add(f"{prefix}ssm_conv1d.{suffix}", arr.reshape(arr.shape[0], -1), router=True).reshape(arr.shape)
    if module == "mamba.norm":
        groups = cfg.n_groups if cfg.model_type == "nemotron_h" else cfg.mamba_n_groups
        return add(prefix + "ssm_norm.weight", arr.reshape(groups, -1), router=True).reshape(arr.shape)
    return add(prefix + {"mamba.in_proj": "ssm_in", "mamba.out_proj": "ssm_out"}[module] + ".weight", arr)


def _add_jamba_mamba(add, prefix: str, suffix: str, arr: np.ndarray) -> np.ndarray:
    """A Jamba Mamba layer's A ([width, state], as -exp(A_log)), D and conv (squeezed) as the converter writes them
    (F32). Returns HF's tensor of what the file holds."""
    if suffix == "A_log":
        return np.log(-add(prefix + "ssm_a", -np.exp(arr), router=True))
    if suffix == "D":
        return add(prefix + "ssm_d", arr)
    return add(f"{prefix}ssm_conv1d.{suffix}", arr.reshape(arr.shape[0], -1), router=True).reshape(arr.shape)


def _reorder_v_heads(tensor: np.ndarray, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> np.ndarray:
    """The converter's (qwen35): value heads grouped by key head -> tiled; with the two counts swapped, back."""
    shape = list(tensor.shape)
    t = tensor.reshape(shape[:dim] + [num_k_heads, num_v_per_k, head_dim] + shape[dim + 1:])
    return np.swapaxes(t, dim, dim + 1).reshape(shape)


def _add_linear_attention(add, prefix: str, module: str, suffix: str, arr: np.ndarray, cfg, tiled: bool,
                          whole_qkvz: bool):
    """A linear-attention layer's tensor as the converter writes it: Qwen3-Next's in_proj_qkvz split into [q, k, v]
    and z (or, whole_qkvz, as older converters did: as it is, ssm_in); A_log as -exp(A_log), dt_bias renamed, the
    conv squeezed (F32); qwen35's value heads tiled (their rows, the conv's value channels, out_proj's columns).
    Returns HF's tensor of what the file holds."""
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r, key = nv // nk, 2 * nk * dk

    def tile(x, dim, width, back=False):
        return _reorder_v_heads(x, dim, *((r, nk) if back else (nk, r)), width) if tiled else x

    def rows_after_key(x, back=False):  # q and k rows as they are, value rows tiled
        return np.concatenate([x[:key], tile(x[key:], 0, dv, back)])
    if suffix == "A_log":
        return tile(np.log(-add(prefix + "ssm_a", -np.exp(tile(arr, 0, 1)))), 0, 1, back=True)
    if suffix == "dt_bias":
        return tile(add(prefix + "ssm_dt.bias", tile(arr, 0, 1)), 0, 1, back=True)
    kind = module.rsplit(".", 1)[1]
    if kind == "in_proj_qkvz" and whole_qkvz:
        return add(prefix + "ssm_in.weight", arr)
    if kind == "in_proj_qkvz":  # per key head [q, k, its value heads' v, z] -> [all q, all k, all v], all z
        groups = arr.reshape(nk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(groups, np.cumsum([dk, dk, r * dv])[:3], axis=1)
        qkv = add(prefix + "attn_qkv.weight", np.concatenate([p.reshape(-1, arr.shape[1]) for p in (q, k, v)]))
        z = add(prefix + "attn_gate.weight", z.reshape(-1, arr.shape[1]))
        parts = np.split(qkv, [nk * dk, key])
        return np.concatenate([p.reshape(nk, -1, arr.shape[1]) for p in (*parts, z)], axis=1).reshape(arr.shape)
    if kind == "in_proj_qkv":
        return rows_after_key(add(prefix + "attn_qkv.weight", rows_after_key(arr)), back=True)
    if kind == "conv1d":
        return rows_after_key(add(prefix + "ssm_conv1d.weight", rows_after_key(arr[:, 0]), router=True),
                              back=True)[:, None]
    if kind == "out_proj":
        return tile(add(prefix + "ssm_out.weight", tile(arr, 1, dv)), 1, dv, back=True)
    if kind == "norm":
        return add(prefix + "ssm_norm.weight", arr)
    gname, width = {"in_proj_ba": ("ssm_ba", 0), "in_proj_z": ("attn_gate", dv), "in_proj_b": ("ssm_beta", 1),
                    "in_proj_a": ("ssm_alpha", 1)}[kind]
    if not width:  # Qwen3-Next's b and a, as HF holds them
        return add(prefix + gname + ".weight", arr)
    return tile(add(prefix + gname + ".weight", tile(arr, 0, width)), 0, width, back=True)


def _add_llama4_experts(add, prefix: str, suffix: str, arr: np.ndarray) -> np.ndarray:
    """Llama 4's stacked experts as its converter writes them: [E, in, out] transposed, gate_up's halves split."""
    out_in = arr.transpose(0, 2, 1)
    if suffix == "down_proj":
        return add(prefix + "ffn_down_exps.weight", out_in).transpose(0, 2, 1)
    ff = out_in.shape[1] // 2
    return np.concatenate([add(prefix + "ffn_gate_exps.weight", out_in[:, :ff]),
                           add(prefix + "ffn_up_exps.weight", out_in[:, ff:])], axis=1).transpose(0, 2, 1)


def _add_gpt_oss(add, prefix: str, suffix: str, arr: np.ndarray) -> np.ndarray:
    """GPT-OSS's sinks and stacked experts as llama.cpp's converter writes them: gate and up (interleaved in HF's
    [E, in, 2 * out]) split, each [E, out, in] in MXFP4, their biases split alike; returns HF's tensor of what the
    file holds."""
    if suffix == "sinks":
        return add(prefix + "attn_sinks.weight", arr)
    if suffix.endswith("_bias"):
        if suffix == "down_proj_bias":
            return add(prefix + "ffn_down_exps.bias", arr)
        held = np.empty_like(arr)
        held[:, 0::2], held[:, 1::2] = add(prefix + "ffn_gate_exps.bias", arr[:, 0::2]), \
            add(prefix + "ffn_up_exps.bias", arr[:, 1::2])
        return held
    if suffix == "down_proj":
        return add(prefix + "ffn_down_exps.weight", arr.transpose(0, 2, 1), qtype=Q.MXFP4).transpose(0, 2, 1)
    held = np.empty_like(arr)
    for kind, half in (("ffn_gate_exps", slice(0, None, 2)), ("ffn_up_exps", slice(1, None, 2))):
        held[:, :, half] = add(f"{prefix}{kind}.weight", arr[:, :, half].transpose(0, 2, 1),
                               qtype=Q.MXFP4).transpose(0, 2, 1)
    return held


def random_model(name: str):
    import transformers

    torch.manual_seed(0)
    config = gguf_family_config(name)
    config._attn_implementation = "eager"
    model = (transformers.Mistral4ForCausalLM(config) if name == "mistral4"  # not among the auto classes
             else transformers.AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():  # norms not at their initial 1 (or Gemma's 0), so a wrong offset shows; biases not 0
        selection_biases = [(n, b) for n, b in model.named_buffers()
                            if n.endswith((".e_score_correction_bias", ".layer_scalar"))]  # and Gemma 4's scales
        for param_name, p in [*model.named_parameters(), *selection_biases]:
            if p.ndim == 1 or param_name.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPELLM_CACHE_DIR", str(tmp_path_factory.mktemp("gguf_cache")))
        yield


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory):
    """name -> (.gguf path, HF greedy reference per prompt on the file's values); each built on first use."""
    built = {}

    def get(name):
        if name not in built:
            model = random_model(name)
            path = tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf"
            held = write_family_gguf(path, name, model)
            model.load_state_dict(held, strict=True)
            built[name] = (str(path), hf_greedy(model, GGUF_PROMPTS))
        return built[name]
    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_family_matches_hf(family_gguf, name):
    path, reference = family_gguf(name)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(path, pipeline_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], params, use_tqdm=False)
        held = {fmt for r in llm.engine.inspect() for fmt, _ in r.weight_bytes}
    assert "Q8_0" in held and (name != "gpt_oss" or "MXFP4" in held)  # the compact kernels ran
    assert_matches_hf(outputs, reference, TOLERANCE.get(name.removesuffix("-ssm_in"), 1e-4))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "granitemoehybrid", "granitemoehybrid-dense", "granitemoe",
                                  "nemotron_h", "nemotron_h-dense", "nemotron_h-latent", "falcon_h1", "jamba", "lfm2",
                                  "lfm2_moe", "bamba", "phi", "starcoder2", "nemotron", "stablelm-parallel",
                                  "gemma4", "gemma4_moe"])
def test_gguf_as_an_hf_folder(tmp_path, name):
    """convert_gguf's HF folder of a file (what `pipellm bench` gives transformers) holds HF's tensors: for qwen3next
    and qwen35, norms less 1, A_log from -exp(A_log), the conv unsqueezed, qwen35's value heads grouped again; for
    Granite's, the experts stacked and the shared MLP's gate and up fused again, under its checkpoints' names; for
    Nemotron-H's, its checkpoints' names (a mixer a layer), the Q/K rows as HF's; for Phi's and StarCoder2's, their
    checkpoints' names, and Nemotron's norms less 1; for Gemma 4's, its layers' own scales and its experts stacked."""
    from transformers import AutoModelForCausalLM

    from pipellm.loader.gguf import convert_gguf
    held = write_family_gguf(tmp_path / "tiny.gguf", name, random_model(name))
    convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))
    state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    assert set(state) == set(held)
    for key, value in held.items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=0, msg=key)


@pytest.mark.parametrize("name", ["gpt_neox", "phi-qkv"])
def test_gguf_fused_qkv_has_no_hf_folder(tmp_path, name):
    """gptneox files (and older phi2 ones) hold q, k and v in one tensor, which HF's checkpoints do not: converting
    one to an HF folder is refused, naming the way that works."""
    from pipellm.loader.gguf import convert_gguf

    write_family_gguf(tmp_path / "tiny.gguf", name, random_model(name))
    with pytest.raises(ValueError, match="attn_qkv.*run the file itself"):
        convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_unsupported_architecture_names_it(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon.gguf: GGUF architecture 'falcon' is not supported"):
        LLM(str(path), pipeline_parallel_size=2, dtype="float32")


def test_unsupported_rope_scaling_names_it(tmp_path):
    path = tmp_path / "dynamic.gguf"
    write_family_gguf(path, "mixtral", random_model("mixtral"),
                      edit=lambda w: w.add_string(gguf.Keys.Rope.SCALING_TYPE.format(arch="llama"), "dynamic"))
    with pytest.raises(ValueError, match="dynamic.gguf: rope scaling 'dynamic' is not supported"):
        LLM(str(path), pipeline_parallel_size=2, dtype="float32")


def test_deepseek_gguf_converts_to_an_hf_folder(family_gguf, tmp_path):
    """A deepseek2 file whose heads' up-projections are split (k_b, v_b) made an HF folder: transformers runs it as
    the model the file was written from (kv_b_proj put together again)."""
    from transformers import AutoModelForCausalLM

    from pipellm.loader.gguf import convert_gguf

    path, reference = family_gguf("deepseek_v3")
    convert_gguf(path, str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert [ids for ids, _ in hf_greedy(model, GGUF_PROMPTS)] == [ids for ids, _ in reference]
