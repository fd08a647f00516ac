import json
import math
import os
import secrets
from dataclasses import dataclass, field

import torch

from pipellm.device import check_name
from pipellm.pipeline.partition import parse_partition

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
                "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                "Exaone4ForCausalLM", "SeedOssForCausalLM", "MinistralForCausalLM", "Glm4ForCausalLM")
OLMO_FAMILY = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
MOE_FAMILY = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "GptOssForCausalLM")
GEMMA_FAMILY = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + MOE_FAMILY + GEMMA_FAMILY + ("GPT2LMHeadModel",)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8}  # kv_cache_dtype, besides "auto"


@dataclass
class RopeConfig:
    """Rotary positions of one kind of layer, as HF's rope_parameters (rope_scaling) give them."""
    rope_type: str = "default"      # one of ROPE_TYPES
    theta: float = 10000.0          # base
    partial_rotary_factor: float = 1.0  # share of head_dim that is rotated (Phi-4-mini: 0.75)
    factor: float = 1.0             # linear, dynamic, llama3, yarn, longrope
    original_max_position_embeddings: int = 0  # llama3, yarn, longrope: the pretraining context
    low_freq_factor: float = 1.0    # llama3
    high_freq_factor: float = 4.0   # llama3
    attention_factor: float | None = None  # yarn, longrope: scale on cos/sin; None = from factor
    beta_fast: float = 32.0         # yarn
    beta_slow: float = 1.0          # yarn
    mscale: float = 0.0             # yarn (DeepSeek style, with mscale_all_dim)
    mscale_all_dim: float = 0.0
    truncate: bool = True           # yarn: round the correction range
    short_factor: tuple[float, ...] = ()  # longrope, per rotated frequency
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()  # llama.cpp's rope_freqs (Llama 3 GGUF): each frequency divided by one

    @classmethod
    def from_hf(cls, d: dict, hf: dict, source: str) -> "RopeConfig":
        """d: one layer kind's rope parameters; hf: the whole config.json (older keys live at its top level)."""
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        theta = d.get("rope_theta", hf.get("rope_theta", 10000.0))
        partial = d.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        original = hf.get("original_max_position_embeddings") if rope_type in ("llama3", "yarn", "longrope") else None
        original = original or d.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
        factor = d.get("factor")
        if factor is None:  # yarn and longrope infer it from the two context lengths
            factor = hf.get("max_position_embeddings", original) / original if rope_type in ("yarn", "longrope") \
                else 1.0
        if rope_type in ("linear", "dynamic", "llama3", "yarn") and "factor" not in d:
            raise ValueError(f"{source}: rope type {rope_type!r} needs a factor")
        rope = cls(rope_type, float(theta), float(partial), float(factor), int(original),
                   float(d.get("low_freq_factor", 1.0)), float(d.get("high_freq_factor", 4.0)),
                   d.get("attention_factor"), float(d.get("beta_fast") or 32), float(d.get("beta_slow") or 1),
                   float(d.get("mscale") or 0), float(d.get("mscale_all_dim") or 0), bool(d.get("truncate", True)),
                   tuple(map(float, d.get("short_factor") or ())), tuple(map(float, d.get("long_factor") or ())),
                   tuple(map(float, d.get("freq_factors") or ())))
        if rope_type == "longrope" and not (rope.short_factor and rope.long_factor):
            raise ValueError(f"{source}: rope type 'longrope' needs short_factor and long_factor")
        return rope


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
    sliding_window: int | None = None  # sliding layers attend to the last sliding_window keys only
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full, or all
    #                                    sliding when sliding_window is set (Mistral)
    rope_local: RopeConfig | None = None  # Gemma 3: rotary of the sliding layers (another base)
    qk_norm: bool = False           # Qwen3, Gemma 3: RMSNorm over each head of q and k before rotary
    hidden_act: str = "silu"        # MLP gate: silu, or gelu_pytorch_tanh (Gemma)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    num_experts: int = 0            # mixture of experts (Mixtral, Qwen3-MoE); 0 = dense MLPs
    num_experts_per_tok: int = 0    # experts each token is routed to
    moe_intermediate_size: int = 0  # width of one expert's MLP
    norm_topk_prob: bool = True     # renormalise the chosen experts' router weights to sum to 1
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers with a dense MLP among the MoE ones
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an expert every token takes, weighted by a sigmoid gate
    nope_layers: tuple[int, ...] = ()   # SmolLM3: layers whose q and k take no rotary positions
    qk_norm_per_head: bool = True       # qk_norm over each head's values; OLMo 2: over all heads' at once
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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"the model's num_attention_heads={self.num_heads} is not a multiple of its "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"the model's layer_types has {len(self.layer_types)} entries for its "
                             f"{self.num_layers} layers")

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
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

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
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architecture {archs or d.get('model_type')} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        quant = d.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method is not None and not (method == "mxfp4" and arch == "GptOssForCausalLM"):
            raise ValueError(f"{source}: weights quantized as {method!r} are not supported (GPT-OSS's mxfp4 is): "
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
                       tie_word_embeddings=d.get("tie_word_embeddings", True), eos_token_ids=eos_ids)
        is_gemma = arch in GEMMA_FAMILY
        act = d.get("hidden_activation" if is_gemma else "hidden_act") or d.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"{source}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
        layers = d["num_hidden_layers"]
        window = d.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                    "SmolLM3ForCausalLM") \
                and not d.get("use_sliding_window", False):
            window = None
        layer_types = tuple(d.get("layer_types") or ())
        if arch == "Gemma3ForCausalLM" and not layer_types:  # older configs: every n-th layer is global
            pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
            layer_types = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                for i in range(layers))
        if arch == "Gemma2ForCausalLM" and not layer_types:
            layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
        if not any(t == "sliding_attention" for t in layer_types):
            layer_types = ()
            if arch != "MistralForCausalLM" and d.get("layer_types"):
                window = None  # every layer is full (Qwen's layer_types without use_sliding_window)
        if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
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
        o_bias = bool(d.get("attention_out_bias", False)) if arch == "SeedOssForCausalLM" else \
            attention_bias and arch != "Glm4ForCausalLM"  # GLM-4: biases on q, k and v only
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        num_experts = d.get("num_local_experts") or d.get("num_experts") or 0
        dense_layers = ()
        if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
            step = d.get("decoder_sparse_step", 1) or 1
            dense_layers = tuple(i for i in range(layers)
                                 if i in (d.get("mlp_only_layers") or ()) or (i + 1) % step != 0)
        nope_layers = ()
        if arch == "SmolLM3ForCausalLM":  # no_rope_layers: 1 where a layer uses rotary positions
            uses_rope = d.get("no_rope_layers") or [int((i + 1) % (d.get("no_rope_layer_interval") or 4) != 0)
                                                    for i in range(layers)]
            nope_layers = tuple(i for i, r in enumerate(uses_rope) if not r)
        if arch == "Exaone4ForCausalLM" and d.get("sliding_window") is not None:  # its full layers: no rotary
            nope_layers = tuple(i for i, t in enumerate(d.get("layer_types") or ()) if t == "full_attention")
        granite = {k: float(d.get(k, 1.0)) for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                                                     "attention_multiplier")} if arch == "GraniteForCausalLM" else {}
        gpt_oss = dict(attention_sinks=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(d.get("swiglu_alpha", 1.702))) if arch == "GptOssForCausalLM" else {}
        return cls(arch, d["vocab_size"], d["hidden_size"], layers, heads,
                   d.get("num_key_value_heads") or heads, head_dim, d["intermediate_size"],
                   d.get("max_position_embeddings", 2048), d.get("rms_norm_eps", 1e-6), rope,
                   tie_word_embeddings=d.get("tie_word_embeddings", is_gemma),
                   qkv_bias=attention_bias or arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"), o_bias=o_bias,
                   sliding_window=window, eos_token_ids=eos_ids, layer_types=layer_types, rope_local=rope_local,
                   qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                                    "Exaone4ForCausalLM") + OLMO_FAMILY,
                   hidden_act=act, query_pre_attn_scalar=d.get("query_pre_attn_scalar") if is_gemma else None,
                   attn_logit_softcapping=d.get("attn_logit_softcapping") if is_gemma else None,
                   final_logit_softcapping=d.get("final_logit_softcapping") if is_gemma else None,
                   num_experts=num_experts if arch in MOE_FAMILY else 0,
                   num_experts_per_tok=d.get("num_experts_per_tok", 0) if arch in MOE_FAMILY else 0,
                   moe_intermediate_size=d.get("moe_intermediate_size") or d["intermediate_size"],
                   norm_topk_prob=arch == "MixtralForCausalLM" or bool(d.get("norm_topk_prob", False)),
                   dense_layers=dense_layers, nope_layers=nope_layers,
                   shared_expert_intermediate_size=(d.get("shared_expert_intermediate_size") or 0)
                   if arch == "Qwen2MoeForCausalLM" else 0,
                   qk_norm_per_head=arch not in OLMO_FAMILY,
                   **granite, **gpt_oss)


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config, its "ngram" method: each decoding request's last prompt_lookup_max down to
    prompt_lookup_min tokens are looked up earlier in its prompt and output, and up to num_speculative_tokens of the
    tokens that followed there are run with its next token in one step; the last stage keeps them up to the first
    that differs from its own pick. A token costs less where the output copies its context (quotes, code edits,
    extraction)."""
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None  # None: prompt_lookup_min, or 5 where both are None (vLLM's defaults)
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"speculative_config {name}={getattr(self, name)!r}: {why}")

        if self.method != "ngram":
            bad("method", 'pipellm speculates by n-gram lookup only: give "ngram" (draft models are not supported)')
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 64:
            bad("num_speculative_tokens", "must be an integer from 1 to 64")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(name, "must be a positive integer or None")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        self.prompt_lookup_max = self.prompt_lookup_max or self.prompt_lookup_min
        self.prompt_lookup_min = self.prompt_lookup_min or self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad("prompt_lookup_min", f"must be at most prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r}: give a dict such as {{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4}")
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; pipellm's are "
                             f"{', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return cls(**value)


DEFAULT_KV_CACHE_GIB = 1.0  # a stage's KV cache on a CPU when kv_cache_gib is unset
MAX_SCHEDULER_STEPS = 1024  # decode steps a batch at most (EngineConfig.num_scheduler_steps)


@dataclass
class EngineConfig:
    model: str | None                   # HF folder or GGUF path; None = the default model
    pipeline_parallel_size: int = 1     # number of stage processes
    layer_partition: list[int] | str | None = None  # layers per stage; None = even; "auto" = profiled balance
    dtype: str = "auto"                 # activations (and uncompressed weights); "auto": float32 unless bf16 measures
    #                                     faster on this CPU (pipeline.profile.auto_dtype)
    block_size: int = 16                # tokens per KV cache block
    max_model_len: int | None = None    # prompt + output tokens; None = the model's limit
    max_num_seqs: int = 64              # requests running at once at most (all batches in flight together)
    max_num_batched_tokens: int | None = None  # tokens in one step at most: small, equal steps keep stages
    #                                     balanced. None: 512, or 256 with several CPU stages, whose pipeline fills
    #                                     (and turns from prefill to decode) a step's time per stage
    kv_cache_gib: float | None = None   # KV cache memory per stage; None: 1 GiB on a CPU; on a GPU, what
    #                                     gpu_memory_utilization leaves after the stage's weights
    kv_cache_dtype: str = "auto"        # "auto" (the activations' dtype), "bfloat16", or "int8" (a scale per block
    #                                     and KV head): fewer bytes per cached token, a little less accuracy
    num_kv_blocks: int | None = None    # exact block count instead of kv_cache_gib (tests, tuning)
    seed: int | None = 0                # seeds requests that do not set their own; None: a random one per engine
    threads_per_stage: int | None = None  # torch threads per stage; None = cores // P
    step_timeout_s: float = 300.0       # a step that takes longer is reported as hung
    heartbeat_timeout_s: float = 3.0    # a stage whose heartbeat is silent this long is stopped: with the 0.5 s
    #                                     beat and poll, a frozen stage is named within 4 s
    auto_partition_prompt_ratio: float = 2.0  # prompt tokens per generated token "auto" balances for
    trace: bool = False                 # record per-batch timings in every stage (pipellm.observe.trace)
    max_batches_in_flight: int | None = None  # micro-batches in the pipeline at once; None = one per stage
    enable_prefix_caching: bool = True  # reuse computed KV blocks of prompt prefixes seen before
    restart_on_failure: bool = False    # when a stage fails, start a new pipeline and re-run unfinished requests
    nnodes: int = 1                     # hosts the stages run on; node k > 0 runs `pipellm stage --node-rank k`
    master_addr: str = "127.0.0.1"      # the driver's rendezvous address (this host's, reachable from the others)
    master_port: int = 0                # its port; 0 = any free port (one host only)
    distributed_executor_backend: str | None = None  # "uni": one stage, run in the driver's own process; "mp": the
    #                                           driver starts this host's stages as processes; "external_launcher":
    #                                           torchrun started every process (RANK, MASTER_ADDR, MASTER_PORT).
    #                                           None: "uni" for one stage on one host, unless restart_on_failure
    #                                           or async_scheduling
    token_file: str | None = None       # the run's shared secret, for stages on other hosts (or PIPELLM_TOKEN);
    #                                     made with a new token if missing. One host needs none: a fresh one per run
    quantization: str | None = None     # "int8" | "int4": an HF checkpoint's linear weights, quantized on load
    int8_activations: bool = False      # True: integer weight codes (GGUF's Q4-Q8 types, quantization) multiply
    #                                     activations rounded to 8 bits per 32, as llama.cpp does: faster decoding,
    #                                     perplexity within 1%, but greedy output may differ where the top two are close
    device: str = "cpu"                 # "cpu", "cuda" (a GPU a stage), "cuda:N" (every stage on GPU N) or "auto"
    gpu_memory_utilization: float = 0.9  # share of each GPU's memory the stages on it may use (weights, KV cache)
    enforce_eager: bool = False         # True: no CUDA graphs on a GPU, every step launched op by op (vLLM's name)
    num_scheduler_steps: int = 1        # decode steps a stage runs per batch, feeding back its own samples (vLLM's
    #                                     multi-step scheduling): less driver round trip per token, output in bursts
    async_scheduling: bool | None = None  # send the next batch while the stage runs this one, its decodes fed the
    #                                     tokens this one samples (vLLM's name): the driver's round trip overlaps
    #                                     the stage's compute (on a CPU while at most 8 requests run); a request that
    #                                     stops has computed one token more, dropped. One stage only; None: on there
    speculative_config: SpeculativeConfig | None = None  # n-gram speculative decoding; a dict of its fields too
    max_logprobs: int = 20              # top log-probabilities a request may ask for a token (logprobs,
    #                                     prompt_logprobs) at most; -1: no cap (vLLM's name and default)
    scheduling_policy: str = "fcfs"     # "fcfs": requests run in arrival order; "priority": by each one's priority
    #                                     (lower first, then arrival), and the last of that order is preempted first

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            bad("pipeline_parallel_size", "must be an integer >= 1")
        if isinstance(self.layer_partition, str):
            self.layer_partition = parse_partition(self.layer_partition)
        if self.layer_partition not in (None, "auto") and (
                not isinstance(self.layer_partition, (list, tuple))
                or any(type(n) is not int for n in self.layer_partition)):
            bad("layer_partition", 'must be layer counts per stage (e.g. [15, 15] or "15,15"), "auto" or None')
        if self.seed is None:
            self.seed = secrets.randbelow(2 ** 63)
        if type(self.seed) is not int or not 0 <= self.seed < 2 ** 63:
            bad("seed", "must be an integer in [0, 2**63), or None for a random one")
        for name, zero in (("step_timeout_s", False), ("heartbeat_timeout_s", False),
                           ("auto_partition_prompt_ratio", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0 <= value < math.inf if zero else 0 < value < math.inf):
                bad(name, f"must be a number {'>= 0' if zero else '> 0'}")
        if self.dtype not in DTYPES and self.dtype != "auto":
            bad("dtype", f"must be one of auto, {', '.join(DTYPES)}")
        if self.quantization not in (None, "int8", "int4"):
            bad("quantization", 'must be "int8", "int4" or None')
        if not isinstance(self.block_size, int) or self.block_size < 1:
            bad("block_size", "must be a positive integer")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            bad("max_model_len", "must be an integer >= 2 or None")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            bad("max_num_seqs", "must be a positive integer")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 256 if self.pipeline_parallel_size > 1 and self.device == "cpu" else 512
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            bad("max_num_batched_tokens", "must be a positive integer")
        if self.kv_cache_dtype not in ("auto", *KV_CACHE_DTYPES):
            bad("kv_cache_dtype", f'must be one of auto, {", ".join(KV_CACHE_DTYPES)}')
        if self.kv_cache_gib is not None and (isinstance(self.kv_cache_gib, bool) or not isinstance(
                self.kv_cache_gib, (int, float)) or not 0 < self.kv_cache_gib < math.inf):
            bad("kv_cache_gib", "must be a number of GiB > 0, or None")
        check_name(self.device)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "must be a fraction in (0, 1]")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            bad("num_kv_blocks", "must be a positive integer or None")
        if self.threads_per_stage is not None and (not isinstance(self.threads_per_stage, int)
                                                   or self.threads_per_stage < 1):
            bad("threads_per_stage", "must be a positive integer or None")
        if self.max_batches_in_flight is not None and (not isinstance(self.max_batches_in_flight, int)
                                                       or self.max_batches_in_flight < 1):
            bad("max_batches_in_flight", "must be a positive integer or None")
        if not isinstance(self.int8_activations, bool):
            bad("int8_activations", "must be True or False")
        if not isinstance(self.num_scheduler_steps, int) or not 1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
            bad("num_scheduler_steps", f"must be an integer from 1 to {MAX_SCHEDULER_STEPS}")
        if not isinstance(self.enforce_eager, bool):
            bad("enforce_eager", "must be True or False")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            bad("async_scheduling", "must be True, False or None (on where it applies)")
        if self.async_scheduling and not self._one_batch_stage:
            bad("async_scheduling", "needs pipeline_parallel_size=1 and max_batches_in_flight unset: with several "
                                    "stages, the batches in flight already overlap the driver's work")
        if self.async_scheduling and self.num_scheduler_steps > 1:
            bad("async_scheduling", "and num_scheduler_steps > 1 are two ways to keep the stage from waiting on the "
                                    "driver; choose one")
        if type(self.max_logprobs) is not int or self.max_logprobs < -1:
            bad("max_logprobs", "must be an integer >= 0, or -1 for no cap")
        if self.scheduling_policy not in ("fcfs", "priority"):
            bad("scheduling_policy", 'must be "fcfs" or "priority"')
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None:
            if self.num_scheduler_steps > 1:
                bad("num_scheduler_steps", "and speculative_config both run several tokens a request a step; "
                                           "choose one")
            if self.async_scheduling:
                bad("async_scheduling", "sends a request's next step before its tokens are back, and speculation "
                                        "needs them to propose the next: leave one of them off")
        if not isinstance(self.enable_prefix_caching, bool):
            bad("enable_prefix_caching", "must be True or False")
        if not isinstance(self.restart_on_failure, bool):
            bad("restart_on_failure", "must be True or False")
        if not isinstance(self.nnodes, int) or not 1 <= self.nnodes <= self.pipeline_parallel_size:
            bad("nnodes", f"must be an integer from 1 to pipeline_parallel_size={self.pipeline_parallel_size} "
                          "(every host runs at least one stage)")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port < 65536:
            bad("master_port", "must be a port number (0 = any free port)")
        if self.nnodes > 1 and self.master_port == 0:
            bad("master_port", "must be set when nnodes > 1: the other hosts connect to it")
        if self.distributed_executor_backend is None:
            one_process = self.pipeline_parallel_size == 1 and self.nnodes == 1 and not self.restart_on_failure \
                and not self.async_scheduling  # both need a stage process
            self.distributed_executor_backend = "uni" if one_process else "mp"
        if self.distributed_executor_backend not in ("uni", "mp", "external_launcher"):
            bad("distributed_executor_backend", 'must be "uni" (the stage in this process), "mp" or '
                                                '"external_launcher" (torchrun), or None')
        if self.distributed_executor_backend == "uni":
            if self.pipeline_parallel_size != 1:
                bad("distributed_executor_backend", "runs one stage, in this process: use \"mp\" for "
                                                    f"pipeline_parallel_size={self.pipeline_parallel_size}")
            if self.restart_on_failure:
                bad("restart_on_failure", 'needs stages in processes of their own: a stage that dies in this process '
                                          'takes it along; use distributed_executor_backend="mp"')
            if self.async_scheduling:
                bad("async_scheduling", "overlaps the driver's work with a stage process's; with the stage in this "
                                        'process there is none to overlap: use distributed_executor_backend="mp"')
        if self.restart_on_failure and self.distributed_executor_backend == "external_launcher":
            bad("restart_on_failure", "needs stages that pipellm starts; under torchrun, use its --max-restarts")

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype != "auto", "the engine resolves dtype='auto' before anything uses it"
        return DTYPES[self.dtype]

    @property
    def _one_batch_stage(self) -> bool:
        return self.pipeline_parallel_size == 1 and self.max_batches_in_flight in (None, 1)

    @property
    def is_async_scheduling(self) -> bool:
        if self.async_scheduling is None:
            return (self._one_batch_stage and self.num_scheduler_steps == 1
                    and self.distributed_executor_backend != "uni" and self.speculative_config is None)
        return self.async_scheduling

    @property
    def batches_in_flight(self) -> int:
        return 2 if self.is_async_scheduling else self.max_batches_in_flight or self.pipeline_parallel_size

    @property
    def num_threads(self) -> int:
        return self.threads_per_stage or max(1, len(os.sched_getaffinity(0)) // self.pipeline_parallel_size)


# generation_config.json key -> SamplingParams field: the sampling defaults a model ships with, as vLLM reads them
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(folder: str) -> dict:
    """The sampling defaults in folder/generation_config.json, under SamplingParams' names; {} without the file."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {name: d[key] for key, name in GENERATION_CONFIG_KEYS.items() if d.get(key) is not None}


def check_generation_config(source: str) -> None:
    """--generation-config: "auto" (the model's generation_config.json), "vllm" (none) or a folder holding one."""
    if source not in ("auto", "vllm") and not os.path.isfile(os.path.join(source, "generation_config.json")):
        raise ValueError(f"--generation-config {source}: no generation_config.json there; give auto, vllm or a "
                         "folder holding one")


def sampling_defaults(source: str, model_dir: str) -> dict:
    """The sampling defaults that --generation-config names, for the model in model_dir."""
    check_generation_config(source)
    return {} if source == "vllm" else generation_defaults(model_dir if source == "auto" else source)
