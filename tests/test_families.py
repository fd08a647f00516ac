"""Every model family and rotary variant, split over stages, equals HF transformers token for token (fp32)."""
import pytest
import torch

from pipellm import LLM, SamplingParams
from pipellm.model_config import ModelConfig
from tests.conftest import VOCAB, NUM_LAYERS, save_tokenizer, spy_chunks_ahead
from tests.test_parity import NEW_TOKENS, PROMPTS

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              eos_token_id=0, bos_token_id=0, pad_token_id=0)
SHORT = 32  # the trained context of the scaled rotary variants: PROMPTS[2] (40 tokens) goes past it
LONG_PROMPT = [(13 * i + 5) % VOCAB for i in range(150)]  # many windows long: the sliding layers' rings wrap
SLIDING_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


GLM_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, image_size=28,
                  patch_size=14)
GLM_VISION_ROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1], partial_rotary_factor=0.5)
# Nemotron-H's: Mamba-2 of 8 heads of 12 in 2 groups; 4 experts in 2 groups, weights scaled; an epsilon that shows
# when it is not read
NEMOTRON_H_SHAPE = dict(head_dim=16, mamba_num_heads=8, mamba_head_dim=12, n_groups=2, ssm_state_size=8,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.5,
                        n_group=2, topk_group=1, layer_norm_epsilon=1e-2)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)  # a tiny tower


def prompts_of(name: str) -> list[list[int]]:
    return PROMPTS if name in ("llama-dynamic", "qwen2-yarn") else PROMPTS + [LONG_PROMPT]  # theirs: 64, 128 tokens


def family_config(name: str):
    import transformers as tf

    if name == "llama3":
        return tf.LlamaConfig(**COMMON, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if name == "llama-linear":
        return tf.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))
    if name == "llama-dynamic":  # HF rescales as the sequence grows past max_position_embeddings
        return tf.LlamaConfig(**COMMON | dict(max_position_embeddings=SHORT),
                              rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    if name == "qwen2-yarn":
        return tf.Qwen2Config(**COMMON | dict(max_position_embeddings=SHORT * 4), rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=SHORT))
    if name == "phi3-longrope":  # partial rotary: half of each head turns; long factors once past SHORT
        rotated_half = 16 * 1 // 2 // 2
        return tf.Phi3Config(**COMMON, original_max_position_embeddings=SHORT, partial_rotary_factor=0.5,
                             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                                  original_max_position_embeddings=SHORT,
                                                  short_factor=[1.0 + 0.1 * i for i in range(rotated_half)],
                                                  long_factor=[2.0 + 0.5 * i for i in range(rotated_half)]))
    if name == "qwen3":  # head_dim 32, not hidden / heads = 16; q/k norms
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
    if name == "gemma2":
        return tf.Gemma2Config(**COMMON, head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
                               attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if name == "gemma3":  # local layers: base 10000, window 24; global: base 1e6 scaled linearly
        return tf.Gemma3TextConfig(**COMMON, head_dim=32, sliding_window=24, query_pre_attn_scalar=32,
                                   layer_types=SLIDING_TYPES,
                                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                    "full_attention": dict(rope_type="linear", rope_theta=1e6,
                                                                           factor=2.0)})
    if name == "mixtral":
        return tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    if name == "phimoe":  # LayerNorms, attention and LM head with biases; longrope scaled by its mscale (prompts
        # within its trained context: HF's Phi-MoE takes the short factors at every length)
        rotated_half = 16 // 2
        return tf.PhimoeConfig(**COMMON | dict(max_position_embeddings=1024), num_local_experts=4,
                               num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                               rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                    original_max_position_embeddings=256, short_mscale=1.25,
                                                    long_mscale=1.25,
                                                    short_factor=[1.0 + 0.1 * i for i in range(rotated_half)],
                                                    long_factor=[2.0 + 0.5 * i for i in range(rotated_half)]))
    if name == "qwen3moe":  # layer 1 dense; router weights not renormalised
        return tf.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 mlp_only_layers=[1], norm_topk_prob=False)
    if name == "smollm3":  # layers 1 and 3 without rotary
        return tf.SmolLM3Config(**COMMON, no_rope_layer_interval=2)
    if name == "granite":
        return tf.GraniteConfig(**COMMON, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                logits_scaling=2.0)
    if name == "olmo2":  # norms after attention and MLP; q/k norms over all heads
        return tf.Olmo2Config(**COMMON)
    if name == "olmo3":  # and sliding layers, with rotary of their own
        return tf.Olmo3Config(**COMMON, sliding_window=24, layer_types=SLIDING_TYPES,
                              rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                               "full_attention": dict(rope_type="linear", rope_theta=1e6,
                                                                      factor=2.0)})
    if name == "gemma":  # Llama's block with Gemma's 1 + w norms, scaled embedding and GeGLU
        return tf.GemmaConfig(**COMMON, head_dim=32)
    if name == "glm4":  # norms after attention and MLP; rotary on half of each head, pairs interleaved
        return tf.Glm4Config(**COMMON, head_dim=32, partial_rotary_factor=0.5)
    if name == "qwen2moe":  # a shared expert beside the routed ones; layer 1 dense
        return tf.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                 shared_expert_intermediate_size=80, mlp_only_layers=[1])
    if name == "exaone4":  # norms after attention and MLP, q/k norms per head; full layers without rotary
        return tf.Exaone4Config(**COMMON, sliding_window=24, layer_types=SLIDING_TYPES)
    if name == "seed_oss":  # q/k/v biases, and one on the attention's output
        return tf.SeedOssConfig(**COMMON, head_dim=32, attention_bias=True, attention_out_bias=True)
    if name == "ministral":  # sliding and full layers
        return tf.MinistralConfig(**COMMON, head_dim=16, sliding_window=24, layer_types=SLIDING_TYPES)
    if name == "ernie4_5":  # rotary pairs interleaved over all of each head; a bias on every linear layer
        return tf.Ernie4_5Config(**COMMON, head_dim=16, use_bias=True, tie_word_embeddings=True)
    if name == "cohere":  # attention and MLP side by side on one LayerNorm; rotary pairs interleaved; logits scaled
        return tf.CohereConfig(**COMMON, logit_scale=0.25)
    if name == "cohere2":  # and sliding layers, the full ones without rotary
        return tf.Cohere2Config(**COMMON, logit_scale=0.25, sliding_window=24, layer_types=SLIDING_TYPES)
    if name in ("cohere2_moe", "cohere2_moe-sigmoid"):  # and experts after two dense layers (full, with rotary), every
        # 2nd layer after them full (without): the top-k logits softmaxed, a shared expert averaged with the routed
        # ones; or (-sigmoid) their sigmoids renormalised, the shared expert summed
        sigmoid = name.endswith("sigmoid")
        return tf.Cohere2MoeConfig(**COMMON | dict(intermediate_size=48), head_dim=16, logit_scale=0.25,
                                   sliding_window=24, sliding_window_pattern=2, num_experts=4, num_experts_per_tok=2,
                                   num_shared_experts=1, first_k_dense_replace=2, prefix_dense_intermediate_size=96,
                                   expert_selection_fn="sigmoid" if sigmoid else "softmax",
                                   shared_expert_combination_strategy="sum" if sigmoid else "average")
    if name == "ernie4_5_moe":  # MoE layers 1 and 3 (every 2nd from 1), a shared expert, experts picked with a bias
        return tf.Ernie4_5_MoeConfig(**COMMON, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=48,
                                     moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=2)
    if name == "hunyuan":  # q/k norms after rotary; a rotary base stretched by NTK alpha
        return tf.HunYuanDenseV1Config(**COMMON, head_dim=16, rope_parameters=dict(
            rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0))
    if name == "hunyuan_moe":  # Hunyuan dense's attention; experts as wide as the shared MLP beside them
        return tf.HunYuanMoEV1Config(**COMMON | dict(intermediate_size=48), head_dim=16, num_experts=4, moe_topk=2,
                                     rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=1000.0,
                                                          factor=1.0))
    if name == "granitemoe":  # Granite's multipliers; experts stacked, the top-k logits softmaxed
        return tf.GraniteMoeConfig(**COMMON | dict(intermediate_size=48), num_local_experts=4, num_experts_per_tok=2,
                                   embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3,
                                   logits_scaling=2.0)
    if name == "granitemoeshared":  # and a shared expert
        return tf.GraniteMoeSharedConfig(**COMMON | dict(intermediate_size=48), num_local_experts=4,
                                         num_experts_per_tok=2, shared_intermediate_size=40, embedding_multiplier=4.0,
                                         residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
    if name in ("granite_swa", "granitemoe_swa"):  # and sliding layers, attention sinks, a rotary base per layer:
        # full layer 1 without rotary, full layer 4 on its own base
        swa = dict(sliding_window=24, layer_types=SLIDING_TYPES, layer_rope_theta=[1e4, 0, 1e4, 1e4, 5e5],
                   embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
        if name == "granite_swa":
            return tf.GraniteSWAConfig(**COMMON, **swa)
        return tf.GraniteMoeSWAConfig(**COMMON | dict(intermediate_size=48), num_local_experts=4,
                                      num_experts_per_tok=2, shared_intermediate_size=40, **swa)
    if name == "olmoe":  # Llama's block, q/k norms over all heads, experts' weights not renormalised
        return tf.OlmoeConfig(**COMMON | dict(intermediate_size=48), num_experts=4, num_experts_per_tok=2)
    if name == "flex_olmo":  # OLMo 2's layers (norms after attention and MLP) with OLMoE's experts
        return tf.FlexOlmoConfig(**COMMON | dict(intermediate_size=48), num_experts=4, num_experts_per_tok=2)
    if name == "arcee":  # Llama's block with an ungated relu(x)**2 MLP; yarn rotary
        return tf.ArceeConfig(**COMMON | dict(max_position_embeddings=SHORT * 8), rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=SHORT))
    if name.startswith(("deepseek", "glm4_moe_lite", "mistral4")):  # latent attention (v narrower than q.k),
        #                                                              grouped routing
        mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                   n_group=4, topk_group=2, first_k_dense_replace=1)
    if name in ("youtu", "minicpm3"):  # latent attention (its rotary pairs interleaved in Youtu's checkpoints, not in
        # MiniCPM3's) before a dense MLP in every layer; MiniCPM3's embedding, blocks and last hidden state scaled
        latent = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, q_lora_rank=48)
        if name == "youtu":
            return tf.YoutuConfig(**COMMON | latent, v_head_dim=12)
        return tf.MiniCPM3Config(**COMMON | latent, scale_emb=4.0, scale_depth=1.2, dim_model_base=32)
    if name == "deepseek_v2":  # one q_proj, experts from the groups of the best expert, biases, yarn scaling q.k
        return tf.DeepseekV2Config(**COMMON | mla | dict(max_position_embeddings=SHORT * 8), q_lora_rank=None,
                                   topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                   attention_bias=True, rope_parameters=dict(
                                       rope_type="yarn", rope_theta=10000.0, factor=8.0, mscale=1.0,
                                       mscale_all_dim=0.8, original_max_position_embeddings=SHORT))
    if name == "deepseek_v3":  # q through a low rank; sigmoid router with a selection bias; weights renormalised
        return tf.DeepseekV3Config(**COMMON | mla, q_lora_rank=48, routed_scaling_factor=2.5)
    if name == "glm4_moe_lite":  # DeepSeek V3's model, its dense layers named one by one
        lite = {k: v for k, v in mla.items() if k != "first_k_dense_replace"}
        return tf.Glm4MoeLiteConfig(**COMMON | lite, q_lora_rank=48, routed_scaling_factor=1.8,
                                    mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse"])
    if name == "deepseek_v3-dense":  # no experts, whose choice a rounding may flip
        return tf.DeepseekV3Config(**COMMON | mla | dict(first_k_dense_replace=NUM_LAYERS), q_lora_rank=48)
    if name == "glm4_moe":  # Llama's attention with q/k norms and rotary on half of each head; DeepSeek V3's experts
        return tf.Glm4MoeConfig(**COMMON | dict(intermediate_size=48), head_dim=16, attention_bias=True,
                                use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5)
    if name == "afmoe":  # Gemma's layer order, OLMo's norms, q/k norms, rotary on sliding layers only, an output gate;
        # experts by sigmoid scores plus a bias, scaled, after a dense layer; the embedding scaled (µP)
        return tf.AfmoeConfig(**COMMON | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                              sliding_window=24, layer_types=SLIDING_TYPES, route_scale=2.5, mup_enabled=True)
    if name == "solar_open":  # Llama's attention (biases on q, k and v), GLM-4.5's experts in every layer
        return tf.SolarOpenConfig(**{k: v for k, v in COMMON.items() if k != "intermediate_size"}, head_dim=16,
                                  attention_bias=True, moe_intermediate_size=32, n_routed_experts=8,
                                  num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                  routed_scaling_factor=1.5)
    if name == "minicpm5_moe":  # Llama's attention, its output gated by a sigmoid of a second query; DeepSeek V3's
        # experts after a dense layer
        return tf.MiniCPM5MoeConfig(**COMMON | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                                    topk_group=1, routed_scaling_factor=1.5)
    if name == "exaone_moe":  # EXAONE 4's attention (full layers without rotary) before Llama's norms; DeepSeek V3's
        # experts after a dense layer
        return tf.ExaoneMoeConfig(**COMMON | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                                  num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, routed_scaling_factor=1.5, sliding_window=24,
                                  layer_types=SLIDING_TYPES)
    if name == "dots1":  # Qwen3's attention (q/k norms, sliding layers), DeepSeek V3's experts
        return tf.Dots1Config(**COMMON | dict(intermediate_size=48), head_dim=16, moe_intermediate_size=32,
                              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=1, routed_scaling_factor=1.5, sliding_window=24,
                              layer_types=SLIDING_TYPES)
    if name == "minimax_m2":  # Mixtral's names; q/k norms over all heads, rotary on half of each; a sigmoid router
        return tf.MiniMaxM2Config(**COMMON | dict(intermediate_size=32), head_dim=16, num_local_experts=8,
                                  num_experts_per_tok=2, rotary_dim=8)
    if name == "apertus":  # q/k norms; an ungated MLP through xIELU, its alphas learned a layer; llama3 rotary
        return tf.ApertusConfig(**COMMON, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    if name == "ministral3":  # Mistral's block; yarn rotary, and Llama 4's temperature on q past SHORT tokens
        return tf.Ministral3Config(**COMMON | dict(max_position_embeddings=SHORT * 8), head_dim=16,
                                   rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=8.0,
                                                        original_max_position_embeddings=SHORT, beta_fast=32.0,
                                                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                                        llama_4_scaling_beta=0.1))
    if name == "mistral4":  # DeepSeek V3's model, a softmax router from groups scored by their best two, no bias;
        #                     Llama 4's temperature on q past SHORT tokens
        return tf.Mistral4Config(**COMMON | mla | dict(max_position_embeddings=SHORT * 8), q_lora_rank=48,
                                 routed_scaling_factor=1.5, rope_parameters=dict(
                                     rope_type="yarn", rope_theta=10000.0, factor=8.0,
                                     original_max_position_embeddings=SHORT, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                     mscale_all_dim=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=8 / 24))
    if name == "glm4v-vl":  # GLM-4.1V's: GLM-4's text model (q/k/v biases always), its rotary multimodal
        return tf.Glm4vConfig(text_config=COMMON | dict(head_dim=16, rope_parameters=GLM_VISION_ROPE),
                              vision_config=GLM_VISION)
    if name == "glm4v_moe-vl":  # GLM-4.5V's: GLM-4.5's, without q/k norms whatever the config says
        return tf.Glm4vMoeConfig(text_config=COMMON | dict(head_dim=16, intermediate_size=48, moe_intermediate_size=32,
                                                           use_qk_norm=True,
                                                           n_routed_experts=8, num_experts_per_tok=2,
                                                           n_shared_experts=1, n_group=2, topk_group=1,
                                                           routed_scaling_factor=1.5, rope_parameters=GLM_VISION_ROPE),
                                 vision_config=GLM_VISION)
    if name == "llava-vl":  # LLaVA's (Pixtral's) checkpoint: a Mistral text model beside a vision tower
        return tf.LlavaConfig(text_config=COMMON | dict(model_type="mistral", head_dim=16), image_token_index=250,
                              vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                                 image_size=28, patch_size=14))
    if name == "internvl-vl":  # InternVL's, a Qwen3 text model
        return tf.InternVLConfig(text_config=COMMON | dict(model_type="qwen3", head_dim=32), image_token_id=250,
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, image_size=[28, 28], patch_size=[14, 14]))
    if name == "aya_vision-vl":  # Aya Vision's, a Cohere 2 text model (sliding layers)
        return tf.AyaVisionConfig(text_config=COMMON | dict(model_type="cohere2", logit_scale=0.25, sliding_window=24,
                                                            layer_types=SLIDING_TYPES), downsample_factor=2,
                                  vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=28, patch_size=14))
    if name == "qwen2_5-vl":  # Qwen2's text model in Qwen2.5-VL's checkpoint (its names a text model's)
        return tf.Qwen2_5_VLConfig(text_config=COMMON | dict(rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
            vision_config=QWEN_VISION | dict(fullatt_block_indexes=[0]))
    if name == "qwen3-vl-moe":  # Qwen3-MoE's in Qwen3-VL-MoE's: experts stacked [E, in, out], always renormalized
        return tf.Qwen3VLMoeConfig(text_config=COMMON | dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=48, rope_parameters=dict(
                                                                 rope_type="default", rope_theta=10000.0,
                                                                 mrope_section=[6, 5, 5], mrope_interleaved=True)),
                                   vision_config=QWEN_VISION | dict(deepstack_visual_indexes=[0]))
    if name == "mistral4-vl":  # Mistral 4's in Mistral 3's vision-language checkpoint (its experts stacked)
        return tf.Mistral3Config(text_config=family_config("mistral4").to_dict(), tie_word_embeddings=False,
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))
    if name == "llama4":  # every 4th layer without rotary (queries scaled past 8 tokens), the others in 16-token
        #                   chunks with weightless q/k norms; experts in every other layer, their inputs weighed
        return tf.Llama4TextConfig(**COMMON | dict(intermediate_size=32), head_dim=16, intermediate_size_mlp=96,
                                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                   attention_chunk_size=16, floor_scale=8, attn_scale=0.5, rope_parameters=dict(
                                       rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=64))
    if name == "gemma3-vl":  # Gemma 3's text model in its vision-language checkpoint (head tied), run alone
        return tf.Gemma3Config(text_config=family_config("gemma3").to_dict(), mm_tokens_per_image=4, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14))
    if name == "gemma4-vl":  # Gemma 4's in its vision-language checkpoint, run alone
        return tf.Gemma4Config(text_config=family_config("gemma4").to_dict(), vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, patch_size=14), audio_config=None)
    if name == "exaone4_5-vl":  # EXAONE 4's in EXAONE 4.5's
        return tf.Exaone4_5_Config(text_config=family_config("exaone4").to_dict(), image_token_id=300,
                                   video_token_id=301, vision_config=dict(
                                       depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                       fullatt_block_indexes=[1]))
    if name == "mistral3-vl":  # Ministral 3's in Mistral 3's (head untied)
        return tf.Mistral3Config(text_config=family_config("ministral3").to_dict(), tie_word_embeddings=False,
                                 vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, head_dim=16, image_size=28, patch_size=14))
    if name in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # linear-attention layers 0-2 and 4 (two value heads a
        # key head), full layer 3 gated; rotary on a quarter of each head; MoE: experts beside a shared one
        linear = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=12, linear_conv_kernel_dim=4)
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=40)
        if name == "qwen3_next":  # layer 1 dense
            return tf.Qwen3NextConfig(**COMMON, **linear, **moe, mlp_only_layers=[1])
        if name == "qwen3_5":
            return tf.Qwen3_5TextConfig(**COMMON, **linear)
        return tf.Qwen3_5MoeTextConfig(**COMMON, **linear, **moe)
    if name == "qwen3_5-vl":  # Qwen3.5's text model in its vision-language checkpoint
        return tf.Qwen3_5Config(text_config=family_config("qwen3_5").to_dict(), vision_config=QWEN_VISION)
    if name == "qwen3_5_moe-vl":  # and Qwen3.5-MoE's
        return tf.Qwen3_5MoeConfig(text_config=family_config("qwen3_5_moe").to_dict(), vision_config=QWEN_VISION)
    if name.startswith("granitemoehybrid"):  # Granite 4.0-H: Mamba-2 layers (8 heads in 2 groups) but layer 2, full
        # and without rotary (as released; the dense one's with it); Granite's multipliers; experts beside a shared MLP
        dense = name.endswith("-dense")
        return tf.GraniteMoeHybridConfig(**COMMON | dict(intermediate_size=48), num_local_experts=0 if dense else 4,
                                         num_experts_per_tok=2, shared_intermediate_size=40,
                                         layer_types=["mamba", "mamba", "attention", "mamba", "mamba"],
                                         mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
                                         position_embedding_type="rope" if dense else None, embedding_multiplier=4.0,
                                         residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=2.0)
    if name.startswith("nemotron_h"):  # Nemotron-H: a mixer a layer: Mamba-2 (8 heads of 12, not hidden * expand /
        # heads, in 2 groups), relu^2 MLPs, attention without rotary, relu^2 experts (groups of them, scaled weights)
        # behind a sigmoid router with a shared expert
        # (-latent: experts on a 32-wide projection, as Nemotron 3 Super's)
        moe = "mlp" if name.endswith("-dense") else "moe"
        return tf.NemotronHConfig(**COMMON, **NEMOTRON_H_SHAPE, layers_block_type=[
            "linear_attention", "mlp", "full_attention", moe, "linear_attention"],
            moe_latent_size=32 if name.endswith("-latent") else None, moe_shared_expert_intermediate_size=40)
    if name.startswith("falcon_h1"):  # Falcon-H1: attention and Mamba-2 (8 heads of 12 in 2 groups: mamba_d_ssm, not
        # hidden * expand) side by side; its Mamba-2 output normed before the gate, after it (-gated) or not at all
        # (-ungated; and biases on the mixer's out_proj); µP multipliers each its own value
        norm = dict(mamba_rms_norm=not name.endswith("-ungated"), mamba_norm_before_gate=not name.endswith("-gated"),
                    projectors_bias=name.endswith("-ungated"))
        return tf.FalconH1Config(**COMMON, **norm, mamba_d_ssm=96, mamba_n_heads=8, mamba_n_groups=2,
                                 mamba_d_state=8, embedding_multiplier=2.0, lm_head_multiplier=0.5,
                                 attention_in_multiplier=0.8, attention_out_multiplier=1.2, key_multiplier=0.7,
                                 ssm_in_multiplier=1.3, ssm_out_multiplier=0.9,
                                 ssm_multipliers=[0.6, 1.1, 0.9, 1.4, 0.5], mlp_multipliers=[1.5, 0.8])
    if name == "jamba":  # Jamba: Mamba mixers (width 128, dt rank 6, not hidden / 16) but layer 2, attention without
        # rotary; experts in layers 1 and 3 (a softmax's top 2, not renormalised)
        return tf.JambaConfig(**COMMON, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
                              expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                              mamba_dt_rank=6)
    if name == "bamba":  # Bamba: Mamba-2 mixers (8 heads in 2 groups) but layer 2, attention with rotary on half of
        # each head (head_dim 32 of 16 rotated pairs, not hidden / heads)
        return tf.BambaConfig(**COMMON, attn_layer_indices=[2], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
                              mamba_d_conv=4, head_dim=32)
    if name == "lfm2":  # LFM2: gated short convolutions (3 taps) but layers 1 and 4, attention with q/k norms; its
        # MLP's width cut to two thirds of 96, rounded up to a multiple of 16 (64)
        return tf.Lfm2Config(**COMMON, full_attn_idxs=[1, 4], block_multiple_of=16)
    if name == "lfm2-vl":  # LFM2's text model in LFM2-VL's checkpoint (a SigLIP 2 tower beside it)
        return tf.Lfm2VlConfig(text_config=family_config("lfm2").to_dict(), projector_hidden_size=32,
                               vision_config=dict(model_type="siglip2_vision_model", hidden_size=32,
                                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                  num_patches=16, patch_size=14))
    if name == "lfm2_moe":  # LFM2-MoE: as LFM2 (its MLP 96 wide), experts from layer 1 (sigmoid scores plus a bias
        # pick 2 of 4, renormalised, scaled by 1.5)
        return tf.Lfm2MoeConfig(**COMMON, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
                                num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                routed_scaling_factor=1.5)
    if name == "llama-mlp-bias":
        return tf.LlamaConfig(**COMMON, mlp_bias=True)
    if name == "gpt_oss":  # attention sinks; sliding and full layers; biased, clamped experts; yarn untruncated
        return tf.GptOssConfig(**COMMON | dict(max_position_embeddings=SHORT * 8), head_dim=16, sliding_window=24,
                               layer_types=SLIDING_TYPES, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
                               rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                                    beta_slow=1.0, original_max_position_embeddings=SHORT,
                                                    truncate=False))
    if name in ("gpt_neox", "gpt_neox-sequential"):  # a quarter of each head rotated; q, k, v rows by head
        return tf.GPTNeoXConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
                                hidden_act="gelu", use_parallel_residual=name == "gpt_neox",
                                rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                     partial_rotary_factor=0.25))
    if name == "phi":  # attention and MLP on one LayerNorm; half of each head rotated; biases, the LM head's too
        return tf.PhiConfig(**COMMON)
    if name == "starcoder2":  # every layer windowed; biases; the tanh GELU without a gate
        return tf.Starcoder2Config(**COMMON, sliding_window=24)
    if name == "nemotron":  # 1 + w LayerNorms, relu^2 without a gate, half of each head rotated
        return tf.NemotronConfig(**COMMON)
    if name in ("stablelm", "stablelm-parallel"):  # LayerNorms, a quarter of each head rotated; q/k/v biases and
        # attention and MLP on one norm (-parallel)
        return tf.StableLmConfig(**COMMON, use_qkv_bias=name == "stablelm-parallel",
                                 use_parallel_residual=name == "stablelm-parallel")
    if name == "helium":  # rotary pairs interleaved; norms scaled in fp32; biases on q, k and v
        return tf.HeliumConfig(**COMMON, head_dim=16, attention_bias=True)
    if name == "vaultgemma":  # Gemma 1's block with Gemma 2's soft caps and sliding layers
        return tf.VaultGemmaConfig(**COMMON, head_dim=16, sliding_window=24, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
    if name in ("gemma4", "gemma4_moe"):  # full-attention layers 1 and 4: one KV head of 32 (their values their
        # keys' projection), rotary on a quarter of each head; the others two of 16; MoE: experts beside the MLP
        moe = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        return tf.Gemma4TextConfig(**COMMON, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                                   attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=24,
                                   layer_types=SLIDING_TYPES, final_logit_softcapping=10.0,
                                   **(moe if name == "gemma4_moe" else {}))
    raise ValueError(name)


FAMILIES = ["llama3", "llama-linear", "llama-dynamic", "qwen2-yarn", "phi3-longrope", "qwen3", "gemma2", "gemma3",
            "mixtral", "phimoe", "qwen3moe", "smollm3", "granite", "olmo2", "olmo3", "exaone4", "seed_oss", "ministral",
            "qwen2moe", "glm4", "gemma", "gpt_oss", "ernie4_5", "llama-mlp-bias", "cohere", "cohere2",
            "ernie4_5_moe", "hunyuan", "granitemoe", "granitemoeshared", "olmoe",
            "arcee", "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1",
            "minimax_m2", "apertus", "ministral3", "mistral4", "gemma3-vl", "mistral3-vl", "llama4", "hunyuan_moe",
            "qwen2_5-vl", "qwen3-vl-moe", "llava-vl", "internvl-vl", "aya_vision-vl",
            "glm4v-vl", "glm4v_moe-vl", "mistral4-vl", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-vl",
            "qwen3_5_moe-vl", "granitemoehybrid", "granitemoehybrid-dense", "nemotron_h", "nemotron_h-dense",
            "nemotron_h-latent", "falcon_h1", "falcon_h1-gated", "falcon_h1-ungated",
            "jamba", "lfm2", "lfm2_moe", "lfm2-vl", "bamba", "gpt_neox", "gpt_neox-sequential", "phi", "starcoder2",
            "nemotron", "stablelm", "stablelm-parallel", "helium", "vaultgemma", "gemma4", "gemma4_moe", "gemma4-vl",
            "flex_olmo", "solar_open", "exaone_moe", "youtu", "minicpm3", "granite_swa", "granitemoe_swa",
            "minicpm5_moe", "exaone4_5-vl", "cohere2_moe", "cohere2_moe-sigmoid", "afmoe"]
# sliding layers (and Llama 4's chunked ones)
WINDOWED = ("gemma2", "gemma3", "gemma3-vl", "olmo3", "exaone4", "ministral", "gpt_oss", "cohere2", "dots1",
            "aya_vision-vl", "llama4", "starcoder2", "vaultgemma", "gemma4", "gemma4_moe", "gemma4-vl", "exaone_moe",
            "granite_swa", "granitemoe_swa", "exaone4_5-vl", "afmoe")
# the log-probabilities' tolerance where fp32 rounding alone moves them further: on these checkpoints HF's own fp32
# ones are up to 1.7e-4 from its fp64 ones, ours up to 3.6e-4 (the delta nets' norms magnify a small head's rounding)
TOLERANCE = dict.fromkeys(("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-vl", "qwen3_5_moe-vl"), 1e-3)
# (pipeline size, partition, step token budget): PP=2 prefills in 16-token chunks
LAYOUTS = [(1, None, 512), (2, [2, 3], 16), (3, [1, 3, 1], 512)]


def hf_greedy(model, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: HF's greedy new ids and the log-softmax of its logits at each step."""
    ref = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        ref.append((out.sequences[0, len(prompt):].tolist(), torch.log_softmax(torch.cat(out.logits).float(), -1)))
    return ref


def assert_matches_hf(outputs, reference, tol: float = 1e-4) -> None:
    """Greedy ids equal, and the top-5 log-probabilities at every step within tol (fp32)."""
    for out, (ref_ids, ref_logprobs) in zip(outputs, reference, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == ref_ids
        for step, entry in enumerate(completion.logprobs):
            for token_id, lp in entry.items():
                assert abs(lp.logprob - ref_logprobs[step, token_id].item()) < tol, (step, token_id)


def make_family_checkpoint(name: str, folder: str):
    """A random checkpoint of family_config(name) (seed 0) with the tests' tokenizer, saved to folder; the HF model."""
    import transformers

    torch.manual_seed(0)
    # Mistral 4 ships inside Mistral 3's vision-language model: AutoModelForCausalLM does not map its config
    config = family_config(name)
    config._attn_implementation = "eager"
    auto = transformers.AutoModelForImageTextToText if "-vl" in name else transformers.AutoModelForCausalLM
    model = (transformers.Mistral4ForCausalLM(config) if name == "mistral4" else auto.from_config(config)).eval()
    with torch.no_grad():  # biases not at their initial 0, so loading them is tested; sinks that weigh; q/k norms
        # whose weights differ within a head; Gemma 4's scales of a layer's output and its router's off 1
        selection_biases = [(n, b) for n, b in model.named_buffers()
                            if n.endswith((".e_score_correction_bias", ".expert_bias", ".layer_scalar"))]
        for param_name, p in [*model.named_parameters(), *selection_biases]:
            if param_name.endswith((".bias", "_bias")):
                torch.nn.init.normal_(p, std=0.2)
            elif param_name.endswith((".sinks", ".alpha_p", ".alpha_n")):  # and xIELU's alphas differ a layer
                torch.nn.init.normal_(p, std=2.0)
            elif param_name.endswith(("q_norm.weight", "k_norm.weight", "query_layernorm.weight",
                                      "key_layernorm.weight", "q_layernorm.weight", "k_layernorm.weight",
                                      ".layer_scalar", "router.scale", ".per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (folder, HF greedy reference per prompt); each family built on first use."""
    built = {}

    def get(name):
        if name not in built:
            folder = str(tmp_path_factory.mktemp(name))
            built[name] = (folder, hf_greedy(make_family_checkpoint(name, folder), prompts_of(name)))
        return built[name]
    return get


# (a vision-language checkpoint's text model, a family above, at PP=2 only: what it adds is its config and names)
CASES = [pytest.param(name, *layout, id=f"{name}-pp{layout[0]}-{layout[1] or 'even'}")
         for name in FAMILIES for layout in LAYOUTS if "-vl" not in name or layout[0] == 2]


@pytest.mark.parametrize("name,pp,partition,budget", CASES)
def test_family_matches_hf(family, name, pp, partition, budget):
    folder, reference = family(name)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    kv_cache_gib = 1.0
    if name in WINDOWED and pp == 2:
        # 30 blocks of a layer a stage: short of one 256-token sequence (16 blocks each for 3 layers), unless the
        # sliding layers cycle through rings of blocks of their own
        cfg = ModelConfig.from_pretrained(folder)
        kv_cache_gib = 30 * (2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4) / 2 ** 30
    with LLM(folder, pipeline_parallel_size=pp, layer_partition=partition, dtype="float32",
             max_num_batched_tokens=budget, kv_cache_gib=kv_cache_gib) as llm:
        ahead = spy_chunks_ahead(llm)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of(name)], params, use_tqdm=False)
        window_ring = llm.engine.window_ring
        assert llm.engine.max_model_len == ModelConfig.from_pretrained(folder).max_context
    # ... a sliding layer's sequence cycling through a ring of 4 blocks (PP=2 steps 16 tokens), not 10 (150 tokens);
    # a chunked one through 3 (a 16-token chunk and a step)
    assert window_ring == ((3 if name == "llama4" else 4) if name in WINDOWED and pp == 2 else 0)
    # ... and prompts' chunks sent while the one before is out (at PP=2, 16 tokens a step), rings included; never
    # where rotary scales with each sequence's known length
    if name in ("llama-dynamic", "phi3-longrope", "phimoe"):
        assert not any(ahead)
    elif pp == 2:
        assert any(ahead)
    assert_matches_hf(outputs, reference, TOLERANCE.get(name, 1e-4))


def test_gemma3_older_config_keys():
    """A Gemma 3 config.json of the first releases (sliding_window_pattern, rope_local_base_freq, rope_scaling) reads
    as transformers reads it."""
    from transformers import Gemma3TextConfig

    old = dict(architectures=["Gemma3ForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
               num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16,
               sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=32)
    theirs = Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"})
    ours = ModelConfig.from_hf_dict(old)
    assert [ours.is_sliding(i) for i in range(8)] == [t == "sliding_attention" for t in theirs.layer_types]
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope.rope_type, ours.rope.theta, ours.rope.factor) == (full["rope_type"], full["rope_theta"],
                                                                       full["factor"])
    assert (ours.rope_local.rope_type, ours.rope_local.theta) == (local["rope_type"], local["rope_theta"])


def test_qwen3_vl_moe_release_expert_layout(family, tmp_path):
    """Qwen3-VL-MoE's releases stack a layer's experts [E, in, out] (transformers transposes them at load, and saves
    them as it holds them): read so, they are the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, reference = family("qwen3-vl-moe")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tensors = {name: t.transpose(1, 2).contiguous() if name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
               else t for name, t in load_file(f"{folder}/model.safetensors").items()}
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(str(tmp_path), dtype="float32") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts_of("qwen3-vl-moe")], params, use_tqdm=False)
    assert_matches_hf(outputs, reference)


def test_chunked_layers_need_a_block_size_dividing_their_chunk(family):
    folder, _ = family("llama4")
    with pytest.raises(ValueError, match="block_size=12 does not divide the model's attention_chunk_size=16"):
        LLM(folder, block_size=12, dtype="float32")


def test_gemma3_vision_language_release_config():
    """Gemma 3's vision-language releases give a few keys of their text model only (the 4B's here): the others are
    HF's defaults, the end tokens the whole model's, as HF's Gemma3ForConditionalGeneration reads them."""
    import transformers

    release = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
               "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                               "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                               "sliding_window": 1024},
               "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelConfig.from_hf_dict(release)
    theirs = transformers.Gemma3Config(**release).get_text_config()
    assert (ours.architecture, ours.text_of) == ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.sliding_window,
            ours.query_pre_attn_scalar) == (theirs.vocab_size, theirs.num_attention_heads, theirs.num_key_value_heads,
                                            theirs.head_dim, theirs.sliding_window, theirs.query_pre_attn_scalar)
    assert [ours.is_sliding(i) for i in range(34)] == [t == "sliding_attention" for t in theirs.layer_types]
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope.rope_type, ours.rope.theta, ours.rope.factor) == ("linear", full["rope_theta"], 8.0)
    assert (ours.rope_local.rope_type, ours.rope_local.theta) == ("default", local["rope_theta"])
    assert ours.eos_token_ids == (1, 106) and ours.tie_word_embeddings


@pytest.mark.parametrize("change,needle", [
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope type 'mrope' is not supported"),
    ({"architectures": ["FalconForCausalLM"]}, "supported: LlamaForCausalLM"),
    ({"hidden_act": "relu"}, "activation 'relu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "needs a factor"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized as 'gptq' are not supported"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantized as 'mxfp4' are not supported"),  # not GPT-OSS
    ({"architectures": ["CohereForCausalLM"], "use_qk_norm": True}, "use_qk_norm=true .* is not supported"),
    ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}},
     "fp8 weights are supported as e4m3 .* activation_scheme='static'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size=None"),  # one scale a tensor
    ({"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 8, "topk_method": "noaux"},
     "topk_method='noaux' is not supported"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 8, "n_routed_experts": 8, "num_experts_per_tok": 4,
      "n_group": 4, "topk_group": 1}, "the kept groups hold at least num_experts_per_tok"),
    ({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"model_type": "qwen2"}},
     "Mistral3ForConditionalGeneration's text model 'qwen2' is not supported"),
    ({"architectures": ["LlavaForConditionalGeneration"], "text_config": {"model_type": "falcon"}},
     r"architecture \['FalconForCausalLM'\] \(the text model of LlavaForConditionalGeneration\) is not supported"),
])
def test_unsupported_config_names_it(change, needle):
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4) | change
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
def test_deepseek_caches_each_tokens_latent_alone(family, kv):
    """MLA's cache holds a token's latent and rotary key once for K and V: as many bytes a token and layer as HF's
    own cache of the model holds (fp32; bfloat16 half of them, int8 about a quarter), and the prompt's and the new
    tokens' log-probabilities, prefilled in 16-token chunks over two stages, are HF's (rounded caches: close to
    them; a model without experts, whose choice a rounding may flip)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from tests.test_kv_cache_dtype import TOLERANCE

    folder, _ = family("deepseek_v3-dense")
    prompt = LONG_PROMPT[:40]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    with LLM(folder, pipeline_parallel_size=2, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=16) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        reports = llm.engine.inspect()
    tokens = prompt + out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens]), cache=cache).logits[0].log_softmax(-1)  # row i scores token i+1
    hf_bytes = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)) / len(cache.layers)
    hf_bytes /= len(tokens)  # a token's in a layer
    ours = {r.kv_cache_bytes / (r.kv_cache_shape[0] * r.kv_cache_shape[1] * r.num_kv_caches) for r in reports}
    engine = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    engine += [step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    err = (torch.tensor(engine) - reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]).abs()
    mean, worst = TOLERANCE.get(kv, (1e-5, 1e-4))
    assert err.mean().item() < mean and err.max().item() < worst
    if kv == "int8":  # int8 values, and a float32 scale a block
        assert hf_bytes / 4 < max(ours) < hf_bytes / 3.9
    else:
        assert ours == {hf_bytes / (2 if kv == "bfloat16" else 1)}


def test_minimax_m2_release_config_rotates_rotary_dim():
    """MiniMax-M2's released config.json gives its rotated width as rotary_dim, no rope_parameters: the share of
    each head that turns is HF's reading of it."""
    import transformers as tf

    d = dict(architectures=["MiniMaxM2ForCausalLM"], vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=4,
             rope_theta=5e6, num_local_experts=4, num_experts_per_tok=2)
    hf = tf.MiniMaxM2Config(**{k: v for k, v in d.items() if k != "architectures"})
    rope = ModelConfig.from_hf_dict(d).rope
    assert rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert rope.theta == hf.rope_parameters["rope_theta"]


def test_phi_3_5_moe_release_config():
    """Phi-3.5-MoE's released config.json (its long- and short-factor lists cut short): its spelling of the
    architecture, longrope scaled by its mscale, a sliding window as long as the context (none), biases, experts."""
    import transformers as tf

    rope = dict(type="longrope", long_factor=[1.0, 1.5], short_factor=[1.0, 1.1], long_mscale=1.243163121016122,
                short_mscale=1.243163121016122, original_max_position_embeddings=4096)
    d = dict(architectures=["PhiMoEForCausalLM"], model_type="phimoe", attention_bias=True, hidden_size=4096,
             intermediate_size=6400, lm_head_bias=True, max_position_embeddings=131072, num_attention_heads=32,
             num_experts_per_tok=2, num_hidden_layers=32, num_key_value_heads=8, num_local_experts=16,
             original_max_position_embeddings=4096, rms_norm_eps=1e-05, rope_scaling=rope, rope_theta=10000.0,
             router_jitter_noise=0.01, sliding_window=131072, tie_word_embeddings=False, vocab_size=32064)
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.architecture == "PhimoeForCausalLM" and cfg.sliding_window is None and cfg.max_context == 131072
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_jitter_eps) == (16, 2, 0.01)
    assert cfg.qkv_bias and cfg.o_bias and cfg.lm_head_bias and not cfg.tie_word_embeddings
    hf = tf.PhimoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert cfg.rope.rope_type == "longrope" and cfg.rope.attention_factor == hf.rope_parameters["short_mscale"]
    assert cfg.rope.short_factor == (1.0, 1.1) and cfg.rope.original_max_position_embeddings == 4096
    with pytest.raises(ValueError, match="num_experts_per_tok=4 is not supported"):
        ModelConfig.from_hf_dict(d | dict(num_experts_per_tok=4))
    with pytest.raises(ValueError, match="long_mscale 2.0 is not supported"):
        ModelConfig.from_hf_dict(d | dict(rope_scaling=rope | dict(long_mscale=2.0)))


def test_selection_bias_stays_fp32_in_a_bf16_model(family):
    """The bias that picks DeepSeek V3's experts among close scores is held as the checkpoint's fp32, exactly, in a
    bf16 model too (as HF keeps it)."""
    from safetensors import safe_open

    from pipellm.loader.safetensors import load_stage_weights
    from pipellm.models.registry import build_stage_model
    from pipellm.pipeline.partition import StageLayers

    folder, _ = family("deepseek_v3")
    cfg = ModelConfig.from_pretrained(folder)
    stage = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True), meta=True)
    load_stage_weights(stage, folder, torch.bfloat16)
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        saved = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    held = stage.layers[1].mlp.selection_bias
    assert saved.dtype == held.dtype == torch.float32 and torch.equal(held, saved)
    assert stage.layers[1].mlp.gate.weight.dtype == torch.bfloat16


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] as float8_e4m3fn and the fp32 scale of each block x block square, DeepSeek's FP8 form."""
    rows, cols = w.shape
    grid = w.reshape(rows // block, block, cols // block, block)
    scales = grid.abs().amax((1, 3)) / 448                                              # [out / b, in / b]
    values = (grid / scales[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return values, scales


def test_deepseek_fp8_checkpoint(tmp_path):
    """A DeepSeek V3 checkpoint with its linear layers in block-scaled FP8 (as the released V3, R1 and Kimi K2) equals
    HF running the weights transformers' own FP8 dequantizer gives, over two stages; the multi-token prediction layer
    the released ones carry after the last (MTP, for speculative decoding) is left unread."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    make_family_checkpoint("deepseek_v3", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    quantized = [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]
    mtp = f"model.layers.{NUM_LAYERS}."  # the layer after the last
    tensors |= {mtp + "eh_proj.weight": torch.randn(64, 128), mtp + "shared_head.head.weight": torch.randn(VOCAB, 64)}
    for name in quantized + [mtp + "eh_proj.weight"]:
        tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(tensors[name], 8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [8, 8]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32  # dequantized, not FP8 matmuls
    reference = hf_greedy(hf, PROMPTS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(str(tmp_path), pipeline_parallel_size=2, dtype="float32") as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        read = {n for r in llm.engine.inspect() for n in r.checkpoint_tensors}
    assert_matches_hf(outputs, reference)
    assert {n + "_scale_inv" for n in quantized} <= read and not any(n.startswith(mtp) for n in read)


def test_fp8_short_edge_blocks_take_their_own_scales():
    """Where a weight's rows or columns are no multiple of the block, the last blocks are short, each with its own
    scale (DeepSeek V3's kv_a_proj_with_mqa: 576 rows in 128-row blocks): blocks whose values differ by powers of
    ten come back within FP8's rounding."""
    from pipellm.quant import fp8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=gen) * 10.0 ** torch.randint(-3, 3, (40, 24), generator=gen)
    w = w * 10.0 ** torch.arange(3).repeat_interleave(16)[:40, None]     # 16-row blocks of another magnitude each
    padded = torch.zeros(48, 32)
    padded[:40, :24] = w
    grid = padded.reshape(3, 16, 2, 16).abs().amax((1, 3)) / 448                        # [3, 2] scales
    values = (padded.reshape(3, 16, 2, 16) / grid[:, None, :, None]).reshape(48, 32)[:40, :24]
    dense = fp8.dequantize(values.to(torch.float8_e4m3fn), grid, (16, 16), torch.float32)
    step = grid.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :24] * 2 ** -9  # e4m3's least, a block
    assert ((dense - w).abs() <= w.abs() / 16 + step).all()
    with pytest.raises(ValueError, match=r"expected float8_e4m3fn \[out, in\] with \[3, 2\] scales"):
        fp8.dequantize(values.to(torch.float8_e4m3fn), grid[:2], (16, 16), torch.float32)


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    """A GPT-OSS checkpoint with its experts in MXFP4 (blocks and scales, as the released ones) equals HF running
    the weights transformers' own dequantizer gives, split over two stages, its experts held compact (5.5 bits a
    weight, the rest fp32; one tensor made dense, as a scale of it has no fp16 form)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = make_family_checkpoint("gpt_oss", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)                                 # [E, in, out]
                experts, cols, rows = param.shape
                blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(123, 126, (experts, rows, cols // 32), generator=gen, dtype=torch.uint8)
                if i == 0 and proj == "down_proj":
                    scales[0, 0, 0] = 100  # 2 ** -27: no fp16 step, so this tensor goes the dense way
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                name = f"model.layers.{i}.mlp.experts.{proj}"
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = hf_greedy(model, PROMPTS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(str(tmp_path), pipeline_parallel_size=2, dtype="float32", kv_cache_gib=0.25) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        held = [dict(r.weight_bytes) for r in llm.engine.inspect()]
    assert_matches_hf(outputs, reference)
    expert_weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
                         and n != "model.layers.0.mlp.experts.down_proj")
    assert sum(h["MXFP4"] for h in held) == expert_weights * 5.5 / 8
    dense = sum(n for h in held for f, n in h.items() if f.startswith("F32"))  # the embedding left in the file too
    assert dense == 4 * (sum(p.numel() for p in model.parameters()) - expert_weights)


def test_gemma4_kv_cache_fits_its_budget_with_wider_full_attention_layers(tmp_path):
    """Gemma 4's full-attention layers cache 4x the bytes a token of its sliding ones do here: the blocks each stage
    holds are counted at each layer's own width, so the caches of the stage they fill first fill the budget, and
    every stage's stay within it."""
    import transformers

    config = family_config("gemma4")
    config.per_layer_config = {i: {"head_dim": 64, "num_key_value_heads": 2} for i in (1, 4)}
    transformers.Gemma4ForCausalLM(config).save_pretrained(tmp_path)
    save_tokenizer(str(tmp_path))
    budget = 2 ** -11  # 512 KiB a stage
    with LLM(str(tmp_path), pipeline_parallel_size=2, dtype="float32", kv_cache_gib=budget, max_model_len=64) as llm:
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)[0]
        used = [r.kv_cache_bytes for r in llm.engine.inspect()]
    assert len(out.outputs[0].token_ids) == 4
    assert 0.9 * budget * 2 ** 30 < max(used) <= budget * 2 ** 30, used


def test_gemma4_release_config_keys():
    """A config.json with the global_* keys HF's Gemma 4 config takes, and no layer_types: every 6th layer and the
    last full, each layer's heads as HF's per_layer_config makes them."""
    from transformers import Gemma4TextConfig

    release = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=24)
    ours = ModelConfig.from_hf_dict({"architectures": ["Gemma4ForCausalLM"], **release})
    theirs = Gemma4TextConfig(**release)
    assert list(ours.layer_types) == theirs.layer_types
    assert [ours.attention_shape(i) for i in range(8)] == [
        (theirs.per_layer_config[i].num_key_value_heads, theirs.per_layer_config[i].head_dim) for i in range(8)]


@pytest.mark.parametrize("key,value,message", [
    ("hidden_size_per_layer_input", 256, "hidden_size_per_layer_input=256 .per-layer input embeddings"),
    ("num_kv_shared_layers", 2, "num_kv_shared_layers=2 .layers that reuse another layer's keys"),
    ("per_layer_config", {"1": {"head_dim": 32}, "4": {"head_dim": 64}}, "the full-attention layers .1, 4. alike")])
def test_gemma4_options_it_cannot_run_are_refused(key, value, message):
    d = family_config("gemma4").to_dict() | {"architectures": ["Gemma4ForCausalLM"], key: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_internlm3_release_config_reads_as_hf_reads_it():
    """InternLM3's releases name InternLM3ForCausalLM and qkv_bias/bias; HF runs them as Llama with attention_bias
    (q, k, v and o) and mlp_bias. A release with the two apart is refused, as HF refuses it."""
    from transformers import InternLM3Config

    release = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, qkv_bias=True, bias=True)
    ours = ModelConfig.from_hf_dict({"architectures": ["InternLM3ForCausalLM"], **release})
    theirs = InternLM3Config(**release)
    assert ours.architecture == "LlamaForCausalLM"
    assert (ours.qkv_bias, ours.o_bias, ours.mlp_bias) == (theirs.attention_bias, theirs.attention_bias,
                                                           theirs.mlp_bias) == (True, True, True)
    with pytest.raises(ValueError, match="InternLM3 with qkv_bias=True and bias=False is not supported"):
        ModelConfig.from_hf_dict({"architectures": ["InternLM3ForCausalLM"], **release, "bias": False})


def test_granite_swa_bases_apart_within_a_kind_of_layer_are_refused():
    d = family_config("granite_swa").to_dict() | {"architectures": ["GraniteSWAForCausalLM"],
                                                   "layer_rope_theta": [1e4, 0, 2e4, 1e4, 5e5]}
    with pytest.raises(ValueError, match=r"gives the sliding_attention layers the bases \[10000.0, 20000.0\]"):
        ModelConfig.from_hf_dict(d)


def test_cohere2_moe_release_config_keys():
    """A config.json without layer_types and mlp_layer_types: the dense layers first_k_dense_replace says, each kind
    of layer its own sliding pattern, as HF's config makes them."""
    from transformers import Cohere2MoeConfig

    release = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=9, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=4, first_k_dense_replace=3,
                   prefix_dense_sliding_window_pattern=2, sliding_window_pattern=3)
    ours = ModelConfig.from_hf_dict({"architectures": ["Cohere2MoeForCausalLM"], **release})
    theirs = Cohere2MoeConfig(**release)
    assert list(ours.layer_types) == theirs.layer_types
    assert [i for i in range(9) if not ours.is_moe(i)] == [i for i, k in enumerate(theirs.mlp_layer_types)
                                                            if k == "dense"]
    with pytest.raises(ValueError, match="Cohere 2 MoE with rms_norm_eps .RMSNorms for its LayerNorms. is not "):
        ModelConfig.from_hf_dict({"architectures": ["Cohere2MoeForCausalLM"], **release, "rms_norm_eps": 1e-5})


@pytest.mark.parametrize("arch", ["Glm4ForCausalLM", "Glm4MoeForCausalLM"])
def test_glm_config_without_partial_rotary_rotates_half_as_hf(arch):
    """A GLM-4 or GLM-4.5 config.json that leaves partial_rotary_factor out: half of each head turns, HF's default."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    theirs = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields)
    ours = ModelConfig.from_hf_dict({"architectures": [arch], **fields})
    assert ours.rope.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("arch", ["Exaone4ForCausalLM", "ExaoneMoEForCausalLM"])
def test_exaone_config_without_layer_types_reads_its_sliding_pattern(arch):
    """EXAONE 4 and K-EXAONE configs that name a sliding window but no layer_types: every sliding_window_pattern-th
    layer full, as HF's config makes them, and "LLLG" the same pattern, as llama.cpp's converter reads it (HF's config
    refuses a string); K-EXAONE's release spelling of its class read as HF's."""
    from transformers import Exaone4Config

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=24, sliding_window_pattern=4)
    theirs = Exaone4Config(**fields).layer_types
    for pattern in (4, "LLLG"):
        ours = ModelConfig.from_hf_dict({"architectures": [arch], **fields, "sliding_window_pattern": pattern})
        assert list(ours.layer_types) == theirs and ours.architecture == arch.replace("MoE", "Moe")
        assert ours.nope_layers == (3, 7)  # the full layers take no rotary
