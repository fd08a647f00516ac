"""Vision-language checkpoints whose text model pipellm runs alone, text in and text out: which they are, their text
model's config as HF reads it, and its tensors' names there. The vision tower is never read."""

# the checkpoint's class -> the model_types its text_config may name (the first where it names none); () any text
# model pipellm runs (LLaVA's, Pixtral's, InternVL's, Aya Vision's: a language model beside a vision tower)
VISION_LANGUAGE = {"LlavaForConditionalGeneration": (), "LlavaNextForConditionalGeneration": (),
                   "LlavaOnevisionForConditionalGeneration": (), "InternVLForConditionalGeneration": (),
                   "AyaVisionForConditionalGeneration": (),
                   "Mistral3ForConditionalGeneration": ("mistral", "ministral3", "mistral4"),
                   "Gemma3ForConditionalGeneration": ("gemma3_text",),
                   "Gemma4ForConditionalGeneration": ("gemma4_text",),
                   "Exaone4_5_ForConditionalGeneration": ("exaone4", "exaone4_5_text"),
                   "Llama4ForConditionalGeneration": ("llama4_text",),
                   "Qwen2VLForConditionalGeneration": ("qwen2_vl_text",),
                   "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_text",),
                   "Qwen3VLForConditionalGeneration": ("qwen3_vl_text",),
                   "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe_text",),
                   "Qwen3_5ForConditionalGeneration": ("qwen3_5_text",),
                   "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe_text",),
                   "Glm4vForConditionalGeneration": ("glm4v_text",),
                   "Glm4vMoeForConditionalGeneration": ("glm4v_moe_text",),
                   "Lfm2VlForConditionalGeneration": ("lfm2",)}
# a text model_type -> the class it runs as, where transformers' causal-LM classes do not name one (Qwen's multimodal
# rotary turns all of a text token's dims by its one position: the text model's own rotary)
TEXT_MODELS = {"mistral4": "Mistral4ForCausalLM", "qwen2_vl_text": "Qwen2ForCausalLM",
               "qwen2_5_vl_text": "Qwen2ForCausalLM", "qwen3_vl_text": "Qwen3ForCausalLM",
               "qwen3_vl_moe_text": "Qwen3MoeForCausalLM", "glm4v_text": "Glm4ForCausalLM",
               "glm4v_moe_text": "Glm4MoeForCausalLM", "exaone4_5_text": "Exaone4ForCausalLM"}
# what HF's text model does whatever its config says: Qwen3-VL-MoE's router renormalizes its top k, GLM-4.1V's q, k
# and v have biases, GLM-4.5V's q and k no norms
AS_HF_RUNS = {"qwen3_vl_moe_text": {"norm_topk_prob": True}, "glm4v_text": {"attention_bias": True},
              "glm4v_moe_text": {"use_qk_norm": False}}


def text_config(d: dict, wrapper: str, source: str) -> dict:
    """The config of a vision-language checkpoint's text model, as HF reads it: its text_config, the keys it leaves
    out at their defaults (Gemma 3's releases give a few only), and those the whole model's config sets for it (its
    head tied or not, its quantization, its end tokens) over it."""
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    allowed = VISION_LANGUAGE[wrapper]
    model_type = text.get("model_type", allowed[0] if allowed else "llama")
    arch = TEXT_MODELS.get(model_type) or _causal_lm_class(model_type)
    if arch is None or allowed and model_type not in allowed:
        raise ValueError(f"{source}: {wrapper}'s text model {model_type!r} is not supported (supported: "
                         f"{', '.join(allowed) if allowed else 'those of the architectures pipellm runs'})")
    try:
        from transformers import AutoConfig
        text = AutoConfig.for_model(model_type, **{k: v for k, v in text.items() if k != "model_type"}).to_dict()
    except (ImportError, ValueError, KeyError):  # a transformers without this model: the keys as they are
        pass
    text |= AS_HF_RUNS.get(model_type, {})
    outer = {k: d[k] for k in ("tie_word_embeddings", "quantization_config", "eos_token_id") if k in d}
    return {**text, **outer, "architectures": [arch]}


def _causal_lm_class(model_type: str) -> str | None:
    """The class transformers runs a text model_type as (a LLaVA's "mistral": MistralForCausalLM), or None."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


# the text model's tensors' prefixes in the checkpoint (transformers 4's, then 5's; Qwen2-VL's a text model's) -> its
# own
TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                       ("model.language_model.", "model."), ("lm_head.", "lm_head."), ("model.", "model."))


def text_model_names(files: dict[str, str]) -> dict[str, str]:
    """The tensors in a vision-language checkpoint's files under the text model's names: its own name -> the file's.
    The vision tower's and the projector's map to no stage's parameter, where they are not left out here."""
    names = {}
    for name in files:
        old, new = next(((old, new) for old, new in TEXT_MODEL_PREFIXES if name.startswith(old)), (None, None))
        if old is not None:
            names[new + name[len(old):]] = name
    return names
