"""The engine's settings (EngineConfig, SpeculativeConfig) and a model folder's sampling defaults; the model's own
shape: model_config.py."""
import json
import math
import os
import secrets
from dataclasses import dataclass

import torch

from pipellm.device import check_name
from pipellm.pipeline.partition import parse_partition

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8}  # kv_cache_dtype, besides "auto"


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
    enable_lora: bool = False           # requests may name a LoRA adapter (a PEFT folder) to run with (vLLM's names)
    max_loras: int = 1                  # adapters the stages hold at once (requests of others wait for a slot)
    max_lora_rank: int = 16             # largest adapter rank taken

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
        if not isinstance(self.enable_lora, bool):
            bad("enable_lora", "must be True or False")
        for name in ("max_loras", "max_lora_rank"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                bad(name, "must be a positive integer")
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
