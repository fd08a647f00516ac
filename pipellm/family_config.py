"""The fields of ModelConfig that some families' config.json files give their own way (model_config.py reads the
rest): the hybrid models' (Granite 4.0-H's and Nemotron-H's Mamba-2 layers among attention ones, Falcon-H1's beside
attention in every layer, Jamba's Mamba layers and LFM2's short convolutions among attention ones:
models/linear_attention.py), DeepSeek's router
and latent attention, Hunyuan's per-layer counts, block-scaled FP8."""
import math

GRANITE_HYBRID = "GraniteMoeHybridForCausalLM"  # Granite 4.0-H: Mamba-2 layers among full-attention ones
BAMBA = "BambaForCausalLM"  # the same Mamba-2 layers among Llama's attention ones, rotary on half of each head
# Nemotron-H: each layer one mixer: Mamba-2, attention without rotary, a relu^2 MLP, or relu^2 experts
NEMOTRON_H = "NemotronHForCausalLM"
FALCON_H1 = "FalconH1ForCausalLM"  # attention and Mamba-2 side by side in every layer, µP multipliers
JAMBA = "JambaForCausalLM"  # Mamba (-1) layers among attention ones, experts every other layer
LFM2 = "Lfm2ForCausalLM"  # gated short convolutions among attention layers
LFM2_MOE = "Lfm2MoeForCausalLM"  # and experts in all but the first layers
# Gemma 4: full-attention layers with heads of their own width (and values that are their keys' projection), experts
# beside the MLP (models/gemma.py)
GEMMA4 = "Gemma4ForCausalLM"
# Granite's and Granite MoE Shared's with sliding layers, attention sinks and a rotary base per layer
GRANITE_SWA, GRANITE_MOE_SWA = "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM"
AFMOE = "AfmoeForCausalLM"  # Arcee's Trinity (models/afmoe.py)
PHIMOE = "PhimoeForCausalLM"  # Phi-3.5-MoE: LayerNorms with biases, a sparsemixer router, an LM head with a bias
# LayerNorms, MLPs without a gate, rotary on part of each head (models/classic.py)
GPT_NEOX, PHI, STARCODER2, NEMOTRON, STABLELM = "GPTNeoXForCausalLM", "PhiForCausalLM", "Starcoder2ForCausalLM", \
    "NemotronForCausalLM", "StableLmForCausalLM"
CLASSIC = (GPT_NEOX, PHI, STARCODER2, NEMOTRON, STABLELM)
GELUS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # exact; the others HF's names of its tanh form
# their checkpoints' names -> Llama's, in turn (models/classic.py; the GGUF loader the other way)
NEOX_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
              ("embed_out.", "lm_head."), ("gpt_neox.layers.", "model.layers."),
              (".attention.query_key_value.", ".self_attn.qkv_proj."), (".attention.dense.", ".self_attn.o_proj."),
              (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
PHI_NAMES = ((".self_attn.dense.", ".self_attn.o_proj."), (".mlp.fc1.", ".mlp.up_proj."),
             (".mlp.fc2.", ".mlp.down_proj."), ("model.final_layernorm.", "model.norm."))
STARCODER2_NAMES = ((".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))


def renamed(name: str, names: tuple, back: bool = False) -> str:
    """A checkpoint's tensor name as Llama's (or, back, Llama's as the checkpoint's)."""
    for theirs, ours in names:
        name = name.replace(ours, theirs) if back else name.replace(theirs, ours)
    return name


# older configs' layer names, and Nemotron-H's hybrid_override_pattern letters: HF's layer types
MAMBA_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention",
                     "M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
NEMOTRON_LAYER_TYPES = ("linear_attention", "full_attention", "mlp", "moe")


def granite_hybrid(d: dict, source: str) -> dict:
    """ModelConfig's Mamba-2 fields of a Granite 4.0-H config.json, as HF reads it."""
    heads, hidden = d.get("mamba_n_heads") or 128, d["hidden_size"]
    width = (d.get("mamba_expand") or 2) * hidden
    head_dim = d.get("mamba_d_head")
    head_dim = width // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != width:
        raise ValueError(f"{source}: Mamba-2 heads of {heads} x {head_dim} for a width of {width} are not supported "
                         "(heads x head width = mamba_expand x hidden_size)")
    return _mamba2(d, source, heads, head_dim, d.get("mamba_n_groups") or 1, d.get("mamba_d_state") or 256,
                   d.get("mamba_d_conv") or 4, d.get("mamba_conv_bias", True), d.get("mamba_proj_bias"))


def bamba(d: dict, source: str) -> tuple[dict, dict]:
    """A Bamba config.json in the keys from_hf_dict reads, and ModelConfig's fields of its own, as HF reads it:
    attention in attn_layer_indices, Mamba-2 mixers in the others; rotary on half of each head, whatever the config
    says (HF's rule)."""
    attention = set(d.get("attn_layer_indices") or ())
    rope = dict(d.get("rope_parameters") or {})
    keys = dict(layer_types=None, partial_rotary_factor=0.5, **({"rope_parameters": rope | dict(
        partial_rotary_factor=0.5)} if rope else {}))
    fields = granite_hybrid(d, source) | dict(layer_types=tuple(
        "full_attention" if i in attention else "linear_attention" for i in range(d["num_hidden_layers"])))
    return d | keys, fields


def nemotron_h(d: dict, source: str) -> tuple[dict, dict]:
    """A Nemotron-H config.json in the keys from_hf_dict reads, and ModelConfig's fields of its own, as HF reads it
    (layers_block_type, or older configs' hybrid_override_pattern; older configs' key names)."""
    types = tuple(MAMBA_LAYER_TYPES.get(t, t) for t in d.get("layers_block_type") or d.get("layer_types")
                  or d.get("hybrid_override_pattern") or ())
    if not types or set(types) - set(NEMOTRON_LAYER_TYPES):
        raise ValueError(f"{source}: Nemotron-H layer types {sorted(set(types) - set(NEMOTRON_LAYER_TYPES))} are "
                         f"not supported: give layers_block_type, each of {', '.join(NEMOTRON_LAYER_TYPES)}")
    moe = "moe" in types
    fields = _mamba2(d, source, d.get("mamba_num_heads") or 128, d.get("mamba_head_dim") or 64,
                     d.get("n_groups") or d.get("mamba_n_groups") or 8, d.get("ssm_state_size") or 128,
                     d.get("conv_kernel") or d.get("mamba_d_conv") or 4,
                     d.get("use_conv_bias", d.get("mamba_conv_bias", True)), d.get("use_bias"))
    fields |= dict(layer_types=types, nope_layers=tuple(range(len(types))),
                   dense_layers=tuple(i for i, t in enumerate(types) if t != "moe"),
                   shared_expert_intermediate_size=(d.get("moe_shared_expert_intermediate_size") or 0) * moe,
                   router_sigmoid=moe, router_selection_bias=moe, shared_expert_gated=False,
                   num_experts=d.get("n_routed_experts", 8) * moe,
                   moe_latent_size=(d.get("moe_latent_size") or 0) * moe,
                   num_experts_per_tok=d.get("num_experts_per_tok", 2) * moe,
                   norm_topk_prob=bool(d.get("norm_topk_prob", True)))
    # attention_head_dim: older configs'; HF's default of 128 otherwise, not hidden_size / heads
    keys = dict(num_hidden_layers=len(types), hidden_act=d.get("mlp_hidden_act") or "relu2",
                rms_norm_eps=d.get("layer_norm_epsilon", 1e-5),
                head_dim=d.get("head_dim") or d.get("attention_head_dim") or 128,
                max_position_embeddings=d.get("max_position_embeddings") or 4096, layer_types=None)
    return d | keys, fields


def falcon_h1(d: dict, source: str) -> tuple[dict, dict]:
    """A Falcon-H1 config.json in the keys from_hf_dict reads, and ModelConfig's fields of its own, as HF reads it:
    its Mamba-2 width mamba_d_ssm (else mamba_expand x hidden_size); its multipliers, the key's folded into the
    attention's scale and the LM head's into the logits' divisor."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: Falcon-H1's hidden_act={d['hidden_act']!r} is not supported (silu: its MLP's "
                         "and its Mamba-2 convolution's activation)")
    hidden, heads = d["hidden_size"], d.get("mamba_n_heads") or 128
    inner = d.get("mamba_d_ssm") or int((d.get("mamba_expand") or 2) * hidden)
    head_dim = d.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != inner:
        raise ValueError(f"{source}: Mamba-2 heads of {heads} x {head_dim} for mamba_d_ssm={inner} are not "
                         "supported (heads x head width = mamba_d_ssm)")
    fields = _mamba2(d, source, heads, head_dim, d.get("mamba_n_groups") or 1, d.get("mamba_d_state") or 256,
                     d.get("mamba_d_conv") or 4, d.get("mamba_conv_bias", True), d.get("mamba_proj_bias"))
    ssm, mlp = d.get("ssm_multipliers") or [1.0] * 5, d.get("mlp_multipliers") or [1.0, 1.0]
    fields |= dict(layer_types=("hybrid",) * d["num_hidden_layers"], mamba_out_bias=bool(d.get("projectors_bias")),
                   mamba_norm="none" if not d.get("mamba_rms_norm") else
                   "norm_then_gate" if d.get("mamba_norm_before_gate", True) else "gated",
                   mup_multipliers=tuple(float(m) for m in [d.get(k, 1.0) for k in (
                       "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
                       "ssm_out_multiplier")] + list(ssm) + list(mlp)),
                   embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
                   logits_scaling=1.0 / float(d.get("lm_head_multiplier", 1.0)))
    head = d.get("head_dim") or hidden // d["num_attention_heads"]
    fields["attention_multiplier"] = float(d.get("key_multiplier", 1.0)) * head ** -0.5  # q.(k m) = m q.k
    return d | dict(layer_types=None, max_position_embeddings=d.get("max_position_embeddings") or 8192), fields


def jamba(d: dict, source: str) -> tuple[dict, dict]:
    """A Jamba config.json in the keys from_hf_dict reads, and ModelConfig's fields of its own, as HF reads it: every
    attn_layer_period-th layer (from attn_layer_offset) attention without rotary, the others Mamba; experts in every
    expert_layer_period-th (from expert_layer_offset), their top-k softmax weights as they are."""
    layers, hidden = d["num_hidden_layers"], d["hidden_size"]
    attn, expert = (d.get(k + "_period") or p for k, p in (("attn_layer", 8), ("expert_layer", 2)))
    attn_at, expert_at = d.get("attn_layer_offset", 4), d.get("expert_layer_offset", 1)
    rank = d.get("mamba_dt_rank", "auto")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: Jamba's hidden_act={d['hidden_act']!r} is not supported (silu: its MLPs' and "
                         "its Mamba convolution's activation)")
    experts = d.get("num_experts") or d.get("num_local_experts") or 16
    experts *= experts > 1  # one: every layer's MLP dense, as HF's
    return d | dict(layer_types=None), dict(
        layer_types=tuple("full_attention" if i % attn == attn_at else "linear_attention" for i in range(layers)),
        nope_layers=tuple(range(layers)), num_experts=experts, num_experts_per_tok=d.get("num_experts_per_tok", 2),
        dense_layers=tuple(i for i in range(layers) if i % expert != expert_at), norm_topk_prob=False,
        mamba1=((d.get("mamba_expand") or 2) * hidden, d.get("mamba_d_state") or 16, d.get("mamba_d_conv") or 4,
                math.ceil(hidden / 16) if rank == "auto" else rank),
        mamba_conv_bias=bool(d.get("mamba_conv_bias", True)), mamba_proj_bias=bool(d.get("mamba_proj_bias")))


def phimoe(d: dict, source: str) -> dict:
    """ModelConfig's fields of a Phi-MoE config.json, as HF reads it: experts as Mixtral's, two a token, picked by
    sparsemixer (router_jitter_noise); its LM head's bias."""
    if d.get("num_experts_per_tok", 2) != 2:
        raise ValueError(f"{source}: Phi-MoE's router picks 2 experts a token; num_experts_per_tok="
                         f"{d['num_experts_per_tok']} is not supported")
    return dict(num_experts=d.get("num_local_experts", 16), num_experts_per_tok=2,
                router_jitter_eps=float(d.get("router_jitter_noise", 0.01)), lm_head_bias=bool(d.get("lm_head_bias")))


def gemma4(d: dict, source: str) -> tuple[dict, dict]:
    """A Gemma 4 config.json with its layer types as HF makes them (every 6th layer full, and the last), and
    ModelConfig's fields of its own, as HF reads it: its full-attention layers' head width and KV
    heads (per_layer_config, or the global_* keys HF's config takes), their values as their keys' projection
    (attention_k_eq_v), attention unscaled, experts beside each layer's MLP (enable_moe_block)."""
    for key, what in (("hidden_size_per_layer_input", "per-layer input embeddings (Gemma 4 E2B's and E4B's)"),
                      ("num_kv_shared_layers", "layers that reuse another layer's keys and values")):
        if d.get(key):
            raise ValueError(f"{source}: {key}={d[key]} ({what}) is not supported; the dense and the MoE Gemma 4 "
                             "models are")
    if d.get("use_bidirectional_attention") == "all":
        raise ValueError(f"{source}: use_bidirectional_attention='all' is not supported (a causal model is)")
    layers = d["num_hidden_layers"]
    types = list(d.get("layer_types") or ("sliding_attention" if (i + 1) % 6 else "full_attention"
                                          for i in range(layers)))
    types[-1] = "full_attention"
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    overrides = {int(i): o for i, o in (d.get("per_layer_config") or {}).items()}
    if not overrides:  # as HF's config builds it from the global_* keys
        global_kv = d.get("num_global_key_value_heads") if d.get("attention_k_eq_v", True) else None
        overrides = {i: {"head_dim": d.get("global_head_dim", 512)} | ({"num_key_value_heads": global_kv}
                                                                       if global_kv else {}) for i in full}
    shapes = {tuple(sorted(o.items())) for o in overrides.values()}
    if set(overrides) != full or len(shapes) > 1 or not set(next(iter(overrides.values()), {})) <= {
            "head_dim", "num_key_value_heads"}:
        raise ValueError(f"{source}: per_layer_config {overrides} is not supported: the full-attention layers "
                         f"{sorted(full)} alike, in head_dim and num_key_value_heads only")
    shape = next(iter(overrides.values()), {})
    family = dict(global_head_dim=shape.get("head_dim", 0), num_global_kv_heads=shape.get("num_key_value_heads", 0),
                  k_eq_v=bool(d.get("attention_k_eq_v")), attention_multiplier=1.0, qk_norm=True)
    if d.get("enable_moe_block"):  # every layer's MLP beside its experts: as an unweighted shared expert
        family |= dict(num_experts=d["num_experts"], num_experts_per_tok=d["top_k_experts"],
                       moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=True,
                       shared_expert_intermediate_size=d["intermediate_size"], shared_expert_gated=False)
    return d | {"layer_types": types}, family


def granite_swa(d: dict, source: str) -> tuple[dict, dict]:
    """A Granite SWA (or Granite MoE SWA) config.json with its layer types as HF makes them (every 4th layer from the
    first full, the others sliding) and its layers' rotary bases (layer_rope_theta, 0: no rotary) as each kind's, and
    ModelConfig's fields of its own: attention sinks, the layers without rotary."""
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    params = d.get("rope_parameters") or {"rope_type": "default", "rope_theta": d.get("rope_theta", 10000.0)}
    thetas = d.get("layer_rope_theta") or [params.get("rope_theta", 10000.0)] * layers
    rope = {}
    for kind in ("full_attention", "sliding_attention"):
        bases = {t for t, k in zip(thetas, types) if k == kind and t}
        if len(bases) > 1:
            raise ValueError(f"{source}: layer_rope_theta gives the {kind} layers the bases {sorted(bases)}; one base "
                             "a kind of layer is supported")
        rope[kind] = params | {"rope_theta": bases.pop() if bases else params.get("rope_theta", 10000.0)}
    d = {"tie_word_embeddings": True, "sliding_window": 128} | d | {"layer_types": types, "rope_parameters": rope}
    return d, dict(attention_sinks=True, nope_layers=tuple(i for i, t in enumerate(thetas) if not t))


def cohere2_moe(d: dict, source: str) -> tuple[dict, dict]:
    """A Cohere 2 MoE config.json with its layer types as HF makes them, its dense MLPs' width as intermediate_size
    (prefix_dense_intermediate_size), and ModelConfig's fields of its own, as HF reads it: experts intermediate_size
    wide after the dense layers, weighed by a softmax of the top-k logits or by their sigmoids; shared experts summed
    with the routed ones or averaged with them; the full layers without rotary, but the dense ones where
    prefix_dense_sliding_window_pattern is 1."""
    if d.get("rms_norm_eps") is not None:
        raise ValueError(f"{source}: Cohere 2 MoE with rms_norm_eps (RMSNorms for its LayerNorms) is not supported")
    layers, width = d["num_hidden_layers"], d.get("intermediate_size", 22528)
    dense = d.get("first_k_dense_replace", 0)
    kinds = d.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
    prefix_pattern, pattern = d.get("prefix_dense_sliding_window_pattern", 1), d.get("sliding_window_pattern", 4)
    types = d.get("layer_types") or [  # each kind's pattern counted from its first layer
        "full_attention" if (i + 1) % p == 0 else "sliding_attention"
        for p, n in ((prefix_pattern, dense), (pattern, layers - dense)) for i in range(n)]
    strategy, selection = d.get("shared_expert_combination_strategy", "average"), d.get("expert_selection_fn",
                                                                                          "softmax")
    if strategy not in ("sum", "average") or selection not in ("softmax", "sigmoid"):
        raise ValueError(f"{source}: shared_expert_combination_strategy={strategy!r} (sum, average) or "
                         f"expert_selection_fn={selection!r} (softmax, sigmoid) is not supported")
    d = {k: v for k, v in d.items() if k != "rms_norm_eps"} | {
        "layer_types": types, "intermediate_size": d.get("prefix_dense_intermediate_size") or width}
    return d, dict(num_experts=d.get("num_experts", 8), num_experts_per_tok=d.get("num_experts_per_tok", 2),
                   moe_intermediate_size=width, dense_layers=tuple(i for i, k in enumerate(kinds) if k == "dense"),
                   shared_expert_intermediate_size=width * d.get("num_shared_experts", 0), shared_expert_gated=False,
                   shared_expert_average=strategy == "average", router_softmax_after_topk=selection == "softmax",
                   router_sigmoid=selection == "sigmoid", norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                   nope_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"
                                     and not (prefix_pattern == 1 and kinds[i] == "dense")))


def afmoe(d: dict, source: str) -> tuple[dict, dict]:
    """An AFMoE config.json with its layer types as HF makes them (every global_attn_every_n_layers-th full), and
    ModelConfig's fields of its own, as HF reads it: the full layers without rotary, an output gate, experts after
    num_dense_layers dense ones, by sigmoid scores plus a selection bias, renormalised and scaled by route_scale,
    beside a shared MLP num_shared_experts experts wide; the embedding scaled with mup_enabled."""
    layers, every = d["num_hidden_layers"], d.get("global_attn_every_n_layers") or 4
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                     for i in range(layers)]
    width = d["moe_intermediate_size"]
    return d | {"layer_types": types}, dict(
        num_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=width,
        dense_layers=tuple(range(d.get("num_dense_layers", 1))),
        shared_expert_intermediate_size=width * d.get("num_shared_experts", 2), shared_expert_gated=False,
        router_sigmoid=True, router_selection_bias=True, norm_topk_prob=True, router_norm_eps=1e-20,
        routed_scaling_factor=float(d.get("route_scale") or 1.0), attention_output_gate=True, qk_norm=True,
        nope_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        embedding_multiplier=d["hidden_size"] ** 0.5 if d.get("mup_enabled") else 1.0)


def exaone_layer_types(d: dict, source: str) -> dict:
    """An EXAONE 4 or K-EXAONE config.json with its layer types where it names none but a sliding window:
    sliding_window_pattern, every n-th layer full (HF's, default 4) or a pattern of L (sliding) and G (full) layers
    repeated ("LLLG", as llama.cpp's converter reads it; HF's config refuses it)."""
    if d.get("layer_types") or d.get("sliding_window") is None:
        return d
    pattern = d.get("sliding_window_pattern", 4)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        full = [pattern[i % len(pattern)] == "G" for i in range(d["num_hidden_layers"])]
    elif isinstance(pattern, int) and pattern > 0:
        full = [(i + 1) % pattern == 0 for i in range(d["num_hidden_layers"])]
    else:
        raise ValueError(f"{source}: sliding_window_pattern={pattern!r} is not supported (a period, or L and G)")
    return d | {"layer_types": ["full_attention" if f else "sliding_attention" for f in full]}


def classic(d: dict, arch: str, source: str) -> tuple[dict, dict]:
    """A GPT-NeoX, Phi, StarCoder2, Nemotron or StableLM config.json in the keys from_hf_dict reads, and
    ModelConfig's fields of its own, as HF reads it: its norms' epsilon, its rotary's share of a head and base
    (GPT-NeoX's rotary_pct and rotary_emb_base), its biases, its residual's form."""
    if d.get("qk_layernorm"):
        raise ValueError(f"{source}: qk_layernorm=true (LayerNorms over each head's q and k) is not supported")
    partial = {GPT_NEOX: d.get("rotary_pct", 0.25), PHI: 0.5, NEMOTRON: 0.5, STARCODER2: 1.0, STABLELM: 0.25}[arch]
    eps = next((d[k] for k in ("layer_norm_eps", "norm_epsilon", "norm_eps") if d.get(k) is not None), 1e-5)
    d = {"partial_rotary_factor": partial, "rope_theta": d.get("rotary_emb_base", 10000.0),
         "tie_word_embeddings": arch == STARCODER2} | d | {"rms_norm_eps": eps}
    if arch == STABLELM:  # Llama's MLP; biases on q, k and v only, where use_qkv_bias says
        return d, dict(qkv_bias=bool(d.get("use_qkv_bias")), o_bias=False, mlp_bias=False,
                       parallel_residual=bool(d.get("use_parallel_residual")))
    bias = bool(d.get("use_bias", True)) if arch == STARCODER2 else bool(d.get("attention_bias", arch != NEMOTRON))
    family = dict(qkv_bias=bias, o_bias=bias, mlp_bias=bias if arch != NEMOTRON else bool(d.get("mlp_bias")),
                  gated_mlp=False, lm_head_bias=arch == PHI, parallel_residual=bool(d.get("use_parallel_residual",
                                                                                          True)) and arch == GPT_NEOX)
    if arch == GPT_NEOX:  # its MLP's biases whatever attention_bias says
        family["mlp_bias"] = True
    return d, family


def lfm2(d: dict, source: str, moe: bool) -> tuple[dict, dict]:
    """An LFM2 config.json in the keys from_hf_dict reads, and ModelConfig's fields of its own, as HF reads it: its
    "conv" layers (layer_types, or all but full_attn_idxs) a gated short convolution of conv_L_cache taps; its
    MLPs' width block_ff_dim (or intermediate_size), cut to two thirds, scaled and rounded up as
    block_auto_adjust_ff_dim says. LFM2-MoE's: its MLPs as wide as intermediate_size says, experts in all but the
    first num_dense_layers, behind a sigmoid router whose expert_bias picks them."""
    layers = d["num_hidden_layers"]
    full = d.get("full_attn_idxs")
    types = d.get("layer_types") or ["full_attention" if full is None or i in full else "conv" for i in range(layers)]
    if set(types) - {"conv", "full_attention"}:
        raise ValueError(f"{source}: LFM2 layer types {sorted(set(types) - {'conv', 'full_attention'})} are not "
                         "supported (conv, full_attention)")
    ff = d.get("block_ff_dim") or d["intermediate_size"]
    if d.get("block_auto_adjust_ff_dim", True) and not moe:
        ff = int(2 * ff / 3)
        if (multiplier := d.get("block_ffn_dim_multiplier", 1.0)) is not None:
            step = d.get("block_multiple_of", 256)
            ff = step * -(-int(multiplier * ff) // step)
    bias = bool(d.get("conv_bias", False))  # on its in_proj, convolution and out_proj alike
    keys = dict(intermediate_size=ff, rms_norm_eps=d.get("norm_eps", 1e-5), layer_types=None,
                tie_word_embeddings=d.get("tie_embedding", d.get("tie_word_embeddings", True)))
    if not d.get("rope_parameters") and not d.get("rope_scaling"):
        keys["rope_theta"] = d.get("rope_theta", 1000000.0)  # HF's default for LFM2
    fields = dict(layer_types=tuple("linear_attention" if t == "conv" else t for t in types),
                  short_conv=d.get("conv_L_cache") or 3, mamba_conv_bias=bias, mamba_proj_bias=bias, qk_norm=True)
    if moe:
        fields |= dict(num_experts=d.get("num_experts", 32), num_experts_per_tok=d.get("num_experts_per_tok", 4),
                       moe_intermediate_size=d.get("moe_intermediate_size", 1792), router_sigmoid=True,
                       router_selection_bias=bool(d.get("use_expert_bias", True)),
                       norm_topk_prob=bool(d.get("norm_topk_prob", True)), router_norm_eps=1e-6,
                       routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                       dense_layers=tuple(range(d.get("num_dense_layers", 2))))
    return d | keys, fields


def _mamba2(d: dict, source: str, heads: int, head_dim: int, groups: int, state: int, kernel: int, conv_bias,
            proj_bias) -> dict:
    # transformers 5 writes infinity as {"__float__": "Infinity"}
    limit = tuple(float(v["__float__"]) if isinstance(v, dict) else float(v)
                  for v in d.get("time_step_limit") or d.get("mamba_dt_limit") or (0.0, float("inf")))
    if limit != (0.0, float("inf")):
        raise ValueError(f"{source}: Mamba-2's time_step_limit={list(limit)} is not supported (no time step limit)")
    if heads % groups:
        raise ValueError(f"{source}: {heads} Mamba-2 heads do not split into {groups} groups")
    return dict(mamba=(heads, head_dim, groups, state, kernel), mamba_conv_bias=bool(conv_bias),
                mamba_proj_bias=bool(proj_bias), mamba_out_bias=bool(proj_bias))


def same_each_layer(d: dict, key: str, source: str) -> int:
    """A Hunyuan MoE config's count that may be given a layer: one value for them all."""
    value = d.get(key) or 1
    if isinstance(value, list) and len(set(value)) > 1:
        raise ValueError(f"{source}: {key} differs between layers ({sorted(set(value))}); one value is supported")
    return value[0] if isinstance(value, list) else value


def group_router(d: dict, source: str, arch: str) -> dict:
    """ModelConfig's router fields of a DeepSeek V2/V3, GLM-4.5, dots.llm1 or Mistral 4 config.json, as HF reads
    them: V2 by its topk_method, Mistral 4 always from groups, the others by noaux_tc (sigmoid, a selection bias)."""
    method = {"DeepseekV2ForCausalLM": d.get("topk_method") or "greedy",
              "Mistral4ForCausalLM": "group_limited_greedy"}.get(arch, "noaux_tc")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ValueError(f"{source}: DeepSeek's topk_method={method!r} is not supported "
                         "(greedy, group_limited_greedy; V3's noaux_tc)")
    groups, kept = (d.get("n_group") or 1, d.get("topk_group") or 1) if method != "greedy" else (1, 1)
    experts, top_k = d.get("n_routed_experts") or 0, d.get("num_experts_per_tok") or 0
    if experts % groups or kept > groups or top_k > kept * (experts // groups):
        raise ValueError(f"{source}: n_group={groups}, topk_group={kept} and num_experts_per_tok={top_k} do not fit "
                         f"n_routed_experts={experts}: the groups must split the experts evenly, and the kept "
                         "groups hold at least num_experts_per_tok experts")
    return dict(expert_groups=groups, expert_groups_kept=kept, group_by_top_expert=arch == "DeepseekV2ForCausalLM",
                routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0))


def latent_attention(d: dict, arch: str) -> dict:
    """ModelConfig's MLA fields of a DeepSeek V2/V3 (or Mistral 4, Youtu, MiniCPM3) config.json: V2's rotary pairs
    always interleaved, MiniCPM3's never; MiniCPM3's values as wide as hidden / heads by default."""
    default_v = d["hidden_size"] // d["num_attention_heads"] if arch == "MiniCPM3ForCausalLM" else 128
    return dict(q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
                qk_rope_head_dim=d.get("qk_rope_head_dim", 64), v_head_dim=d.get("v_head_dim") or default_v,
                rope_interleave=arch == "DeepseekV2ForCausalLM" or arch != "MiniCPM3ForCausalLM"
                and bool(d.get("rope_interleave", True)))


def fp8_weight_block(quant: dict, source: str) -> tuple[int, int]:
    """The block of a block-scaled fp8 quantization_config (HF's FineGrainedFP8, DeepSeek's), made dense at load."""
    block = quant.get("weight_block_size")
    if quant.get("fmt", "e4m3") != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic" \
            or not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{source}: fp8 weights are supported as e4m3 with a weight_block_size of two ints and the "
                         f"dynamic activation_scheme; this quantization_config has fmt={quant.get('fmt')!r}, "
                         f"weight_block_size={block!r}, activation_scheme={quant.get('activation_scheme')!r}")
    return tuple(block)
