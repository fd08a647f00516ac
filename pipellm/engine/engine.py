"""The driver: queues requests its input processor has checked, schedules them, keeps batches in flight through the
pipeline, and hands their sampled tokens to its output processor (stops, log-probabilities, text)."""
import dataclasses
import itertools
import json
import logging
import os
import time
from collections import deque
from datetime import timedelta

from pipellm import device, kernels
from pipellm.config import EngineConfig
from pipellm.engine.block_manager import BlockManager
from pipellm.engine.input_processor import InputProcessor
from pipellm.engine.kv_budget import kv_budget
from pipellm.engine.output_processor import OutputProcessor
from pipellm.engine.saved_states import SavedStates
from pipellm.engine.scheduler import ScheduledBatch, Scheduler
from pipellm.engine.sequence import Request
from pipellm.loader.gguf import gguf_source
from pipellm.loader.model_folder import load_tokenizer, resolve_model
from pipellm.loader.safetensors import checkpoint_files
from pipellm.lora import Adapters, LoRARequest
from pipellm.model_config import ModelConfig
from pipellm.observe.trace import TraceRecorder
from pipellm.outputs import RequestOutput
from pipellm.pipeline import comm, wire
from pipellm.pipeline.executor import PipelineError, PipelineExecutor
from pipellm.pipeline.local import LocalExecutor
from pipellm.pipeline.messages import SampledBatch
from pipellm.pipeline.partition import make_partition
from pipellm.sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads per-completion seeds apart
ASYNC_CPU_MAX_SEQS = 8  # running requests up to which a CPU stage runs decodes ahead (async scheduling)
RESTART_LIMIT, RESTART_WINDOW_S = 3, 60.0  # this many failures within the window: a stage keeps dying, stop
log = logging.getLogger("pipellm")


def warn_if_oversubscribed(config: EngineConfig) -> None:
    """Warns where this host's stages would run more torch threads than it has cores: a matmul's threads wait for
    each other, so one thread off its core stalls the rest (64 threads on a 2-core machine decoded 12x slower)."""
    cores = len(os.sched_getaffinity(0))
    stages = -(-config.pipeline_parallel_size // config.nnodes)  # on this host
    threads = config.threads_per_stage or max(1, cores // stages)
    if stages * threads > cores:
        fix = (f"at most {cores} stage(s) a host" if stages > cores else
               f"threads_per_stage={cores // stages} or fewer")
        log.warning("%d stage(s) x %d thread(s) on this host's %d cores: more threads than cores, which slows every "
                    "matmul; use %s", stages, threads, cores, fix)


def warn_if_slow_dtype(dtype: str) -> None:
    if dtype == "bfloat16" and kernels.cpu_flags() and not kernels.has_bf16_matmul():
        log.warning("dtype='bfloat16' on a CPU without bf16 instructions (no avx512_bf16 or amx_bf16): torch's bf16 "
                    "matmul runs a scalar loop here, 30-70x slower than float32; use dtype='float32'")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        device.bound_onednn_caches()  # before the matmuls that dtype/partition "auto" time here
        self.model_dir = resolve_model(config.model)
        gguf_file = gguf_source(self.model_dir)
        compact = gguf_file is not None or config.quantization is not None
        self.device = device.resolve(config.device)  # this host's; a stage on another host resolves its own
        on_gpu = self.device != "cpu"
        if on_gpu:
            device.check_gpu_options(config, self.device)
        if config.dtype == "auto":
            from pipellm.pipeline.profile import auto_dtype
            dtype, why = (device.gpu_dtype(), "a GPU") if on_gpu else auto_dtype(config.num_threads, compact)
            log.info("dtype auto: %s (%s)", dtype, why)
            config = dataclasses.replace(config, dtype=dtype)
        if not on_gpu:
            warn_if_slow_dtype(config.dtype)
            warn_if_oversubscribed(config)
        self.config = config
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        if gguf_file is None:
            checkpoint_files(self.model_dir)  # fail here, before any process starts, if the weights are missing
        elif config.quantization:
            raise ValueError(f"quantization={config.quantization!r}: a GGUF file's weights are quantized already "
                             "and stay in their own formats; leave quantization unset")
        elif not on_gpu:  # (a GPU stage dequantizes at load: our kernels are CPU code)
            kernels.load()  # build the compact-weight kernels once, here, rather than in every stage
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_context
        if self.max_model_len > mc.max_context:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context of {mc.max_context} "
                             f"(max_position_embeddings={mc.max_position_embeddings}, rope {mc.rope.rope_type})")
        if config.speculative_config is not None and mc.keeps_states:
            raise ValueError(f"speculative_config: {mc.architecture}'s linear-attention (or Mamba) layers keep one "
                             "state a sequence, which cannot step back from rejected drafts; leave speculative_config "
                             "unset")
        self.adapters = Adapters(mc, config.max_lora_rank) if config.enable_lora else None
        if mc.attention_chunk % config.block_size:
            raise ValueError(f"block_size={config.block_size} does not divide the model's attention_chunk_size="
                             f"{mc.attention_chunk}: give a block_size that does (16 does for Llama 4's 8192)")
        self.partition_note = None
        partition = config.layer_partition
        if partition == "auto":
            from pipellm.pipeline.profile import balanced_partition, describe_choice, profile_costs
            make_partition(mc.num_layers, config.pipeline_parallel_size)  # same checks as an even split
            costs = profile_costs(mc, config, compact=compact)
            partition = balanced_partition(mc.num_layers, config.pipeline_parallel_size, costs)
            self.partition_note = describe_choice(mc.num_layers, config.pipeline_parallel_size, costs)
        self.stages = make_partition(mc.num_layers, config.pipeline_parallel_size, partition)
        budget = kv_budget(mc, config, self.stages, self.device, self.max_model_len)
        self.window_ring, self.num_blocks, self.num_window_blocks = budget.ring, budget.num_blocks, budget.ring_blocks
        self.max_model_len = budget.max_model_len
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_token_ids = self._eos_token_ids()
        self.inputs = InputProcessor(self.tokenizer, self.model_config, self.model_dir, self.max_model_len,
                                     self.eos_token_ids, config.max_logprobs, config.scheduling_policy)
        self.block_manager = self._block_manager()
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   mc.rope.original_max_position_embeddings if mc.rope.rope_type == "longrope" else None,
                                   send_rope_lens=mc.rope.rope_type in ("dynamic", "longrope"),
                                   num_scheduler_steps=config.num_scheduler_steps,
                                   steps_alone=config.batches_in_flight > 1,
                                   run_ahead_max_seqs=self._run_ahead_max_seqs(),
                                   chunks_ahead=config.pipeline_parallel_size > 1 and config.batches_in_flight > 1,
                                   speculative_config=config.speculative_config,
                                   by_priority=config.scheduling_policy == "priority",
                                   max_loras=config.max_loras if config.enable_lora else 0)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.scheduler)
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}  # a user's request id -> its completions' ids, to find them by id
        self.in_flight: deque[ScheduledBatch] = deque()
        self.num_generated_tokens = 0     # every token applied to a request, aborted ones' included
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding: drafts run, and kept
        self._request_counter = itertools.count()
        self.tracer = TraceRecorder() if config.trace else None
        self.failures: list[float] = []   # monotonic times of pipeline failures, for the restart limit
        self.restarts: list[dict] = []    # per restart: its cause, and how long the new pipeline took to start
        self.dropped: list[tuple[Request, str]] = []  # requests a failure dropped (Scheduler.drop_suspects), and
        #                                               the failure: for the caller to report and clear
        self.restarting: str | None = None  # the cause, while a restart is under way
        # the stage in this process needs no rendezvous: no store, no port open
        self.store = None if config.distributed_executor_backend == "uni" else \
            comm.SignedStore(self._make_store(), self._token())
        if config.distributed_executor_backend == "mp":
            self.store.set(comm.NNODES_KEY, str(config.nnodes))  # node agents check it, and their token
        self.executor = self._start_pipeline()

    def _run_ahead_max_seqs(self) -> int:
        if not self.config.is_async_scheduling:
            return 0
        # A CPU stage shares its cores with the driver: there, overlapping them pays only while a step is short next
        # to the round trip between them; with more sequences the driver's work is better done while the stage
        # waits for it (BENCHMARKS.md: async scheduling). A GPU computes apart from the driver's cores.
        return ASYNC_CPU_MAX_SEQS if self.device == "cpu" else self.config.max_num_seqs

    @property
    def prefix_caching(self) -> bool:
        # dynamic and longrope rotary turn a key by the length of its whole sequence: a prefix's K/V is not shareable;
        # nor is a prefix that sliding-window layers overwrote in their rings
        return self.config.enable_prefix_caching and not self.window_ring and \
            self.model_config.rope.rope_type not in ("dynamic", "longrope")

    def _block_manager(self) -> BlockManager:
        # int8 caches: a later token written into a block may re-round what it holds, so a partial block's first
        # tokens are not what a request that goes on from them would compute
        # layers that keep a state take a cached prefix only where a state was saved: max_num_seqs of them
        saved = SavedStates(self.config.max_num_seqs) if self.model_config.keeps_states else None
        return BlockManager(self.num_blocks, self.config.block_size, self.prefix_caching, self.num_window_blocks,
                            self.window_ring, reuse_partial=self.config.kv_cache_dtype != "int8", saved=saved)

    def _token(self) -> bytes:
        """The run's shared secret. One host: a fresh one, handed to the stages by their parent. Several hosts:
        PIPELLM_TOKEN or token_file, which the other hosts get a copy of (a missing file is made, readable by its
        owner only)."""
        cfg = self.config
        if os.environ.get(wire.TOKEN_ENV) or (cfg.token_file and os.path.exists(cfg.token_file)):
            return wire.token_from_env_or_file(cfg.token_file)
        if cfg.token_file is not None:
            if cfg.distributed_executor_backend == "external_launcher":
                wire.read_token_file(cfg.token_file)  # raises: every torchrun process needs the same file
            token = wire.write_token_file(cfg.token_file)
            log.warning("wrote a new token to %s: copy it to the other hosts and give it to `pipellm stage "
                        "--token-file`", cfg.token_file)
            return token
        if cfg.nnodes > 1 or cfg.distributed_executor_backend == "external_launcher":
            raise ValueError(f"stages on other hosts need the run's shared secret: give token_file (--token-file "
                             f"FILE; made with a new token if missing, then copied to the other hosts) or set "
                             f"{wire.TOKEN_ENV} on every host")
        return wire.new_token().encode()

    def _make_store(self):
        """The rendezvous store every stage connects to. Under torchrun, its agent on the first host holds one
        already at MASTER_ADDR:MASTER_PORT; otherwise this process serves it."""
        cfg = self.config
        if cfg.distributed_executor_backend == "external_launcher":
            world_size = int(os.environ.get("WORLD_SIZE", 0))
            if world_size != len(self.stages) + 1:
                raise ValueError(f"torchrun started {world_size} processes, but pipeline_parallel_size="
                                 f"{len(self.stages)} needs {len(self.stages) + 1} (the driver, then one per stage)")
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            return comm.make_store(cfg.master_addr, cfg.master_port, is_master=not agent_store)
        return comm.make_store(cfg.master_addr, cfg.master_port, is_master=True)

    def _start_pipeline(self) -> PipelineExecutor | LocalExecutor:
        if self.config.distributed_executor_backend == "uni":
            return LocalExecutor(self.model_dir, self.model_config, self.config, self.stages, self.num_blocks,
                                 self.num_window_blocks, generation=len(self.restarts))
        return PipelineExecutor(self.model_dir, self.model_config, self.config, self.stages, self.num_blocks,
                                self.store, generation=len(self.restarts), num_window_blocks=self.num_window_blocks)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_cfg = os.path.join(self.model_dir, "generation_config.json")
        if os.path.isfile(gen_cfg):
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------------------------------------

    def check_lora(self, lora_request: LoRARequest | None, replace: bool = False) -> bytes:
        """ValueError unless the engine can run this adapter (None: the base model); adds a new one (replace: in
        place of another of its name). Returns the salt of its requests' cached prefixes."""
        if lora_request is None:
            return b""
        if self.adapters is None:
            raise ValueError("lora_request: this engine takes no LoRA adapters; start it with enable_lora=True "
                             "(--enable-lora), max_loras and max_lora_rank as the adapters need")
        return self.adapters.check(lora_request, replace)

    def add_lora(self, lora_request: LoRARequest, replace: bool = False) -> bool:
        """vLLM's: checks the adapter against the model and adds it (ValueError if it cannot run; replace: in place
        of another adapter of its name, which stays if this one cannot); a request naming it later loads it into a
        slot."""
        self.check_lora(lora_request, replace)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: forgets the adapter of that id (False if none has it). Requests of it that were added already
        run to their end with it; its name and id are free for another adapter."""
        return self.adapters is not None and self.adapters.remove(lora_id) is not None

    def list_loras(self) -> set[int]:
        """vLLM's: the ids of the adapters added."""
        return set() if self.adapters is None else {lora.lora_int_id for lora, _ in self.adapters.known.values()}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queues one prompt (params.n completions), run with the LoRA adapter lora_request if given. Call
        inputs.validate() (and inputs.check_priority()) first."""
        salt = self.check_lora(lora_request)
        prompt_token_ids = self.inputs.truncated(prompt_token_ids, params)
        rids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        if request_id in self.groups or any(rid in self.requests for rid in rids):
            raise ValueError(f"request id {request_id!r} is already in use")
        counter = next(self._request_counter)
        base_seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + counter
        max_tokens = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        self.groups[request_id] = rids
        bad_words = self.inputs.bad_words_token_ids(params.bad_words or [])
        stop_ids = self.inputs.min_tokens_stop_ids(params)
        for i, rid in enumerate(rids):
            req = Request(rid, list(prompt_token_ids), params, (base_seed + i * _SEED_STRIDE) % 2 ** 63,
                          max_tokens, index=i, parent_id=request_id if params.n > 1 else None,
                          # a cached prefix is not run again, so its log-probabilities would be missing
                          use_prefix_cache=params.prompt_logprobs is None, priority=priority)
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None] * len(prompt_token_ids)
            req.min_tokens_stop_ids, req.bad_words_token_ids = stop_ids, bad_words
            if lora_request is not None:
                req.lora_request, req.cache_salt = lora_request, salt
            self.requests[rid] = req
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        for rid in self.groups.pop(request_id, []):
            req = self.requests.pop(rid)
            if not req.is_finished:
                self.scheduler.finish(req, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's reset_prefix_cache: timings of cold prompts, say). False, and nothing
        forgotten, while requests run."""
        return not (self.has_unfinished_requests() or self.in_flight) and self.block_manager.reset_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- stepping -------------------------------------------------------------------------------------------

    def step(self, fill: bool = True) -> list[Request]:
        """Fills the pipeline, then waits for the oldest batch. Returns the requests that got a token.
        fill=False submits nothing new, so repeated calls empty the pipeline (inspect() needs it empty).
        When a stage fails: with restart_on_failure, restarts the pipeline (no request gets a token this step);
        otherwise raises PipelineError, naming the stage."""
        try:
            return self._step(fill)
        except PipelineError as e:
            self.restart(e)
            return []

    def check_pipeline(self) -> None:
        """For an idle driver: notices a stage that died between steps, and restarts or raises as step() does."""
        if not self.executor.is_alive():
            self.restart(self.executor.failure())

    def restart(self, error: PipelineError) -> None:
        """Replaces a failed pipeline with a new one and queues every unfinished request to run again from its
        prompt plus the tokens it has already generated. A new pipeline that fails to start is a failure too.
        Raises the failure when restarts are off, or after RESTART_LIMIT failures within RESTART_WINDOW_S."""
        if not self.config.restart_on_failure:
            raise error
        out = list({id(r): r for b in self.in_flight for r in b.requests if not r.is_finished}.values())
        self.executor.shutdown()
        self.in_flight.clear()
        # a stage that raised (or crashed) may have failed on a request's input, which would fail every pipeline
        dropped = self.scheduler.drop_suspects(out) if error.raised else []
        self.dropped += [(r, str(error)) for r in dropped]
        # The new stages' KV caches are empty: forget every block, cached prefixes included.
        self.block_manager = self._block_manager()
        self.scheduler.requeue_all(self.block_manager)
        while True:
            now = time.monotonic()
            self.failures = [t for t in self.failures if now - t < RESTART_WINDOW_S]
            if not dropped:  # a failure that dropped its likely cause is progress, not a stage that keeps dying
                self.failures.append(now)
            dropped = []
            if len(self.failures) >= RESTART_LIMIT:
                self.restarting = None
                raise PipelineError(f"{error}\nThe pipeline failed {len(self.failures)} times within "
                                    f"{RESTART_WINDOW_S:.0f} s; not restarting it again") from error
            log.warning("%s; restarting the pipeline and re-running %d unfinished requests", error,
                        self.scheduler.num_unfinished)
            self.restarting = str(error)
            self.restarts.append({"error": str(error), "detected_at": now})
            try:
                self.executor = self._start_pipeline()
            except PipelineError as e:
                error = e
                continue
            self.restarts[-1]["start_s"] = time.monotonic() - now
            self.restarting = None
            log.warning("pipeline restarted in %.1f s", self.restarts[-1]["start_s"])
            return

    def _step(self, fill: bool) -> list[Request]:
        num_batches = self.config.batches_in_flight
        while fill and len(self.in_flight) < num_batches:
            if self.config.is_async_scheduling:
                # one stage: a batch out and, while few requests run, the next step of its decodes sent ahead of it
                batch = self.scheduler.schedule()
            else:
                # Split the work evenly over the batches in flight, in decodes, and in tokens over the batch slots
                # still free, so that no stage waits behind a big batch.
                seqs = -(-self.scheduler.num_unfinished // num_batches)
                tokens = -(-self.scheduler.num_schedulable_tokens // (num_batches - len(self.in_flight)))
                batch = self.scheduler.schedule(max_num_seqs=max(1, seqs), max_num_tokens=max(1, tokens))
            if batch is None:
                break
            self.in_flight.append(batch)  # first: a failure while it is sent counts its requests as out
            self.executor.submit(batch.stage_batch)
            if self.tracer:
                bm = self.block_manager
                self.tracer.on_submit(batch.batch_id, batch.stage_batch.num_tokens, len(batch.requests),
                                      bm.num_blocks - bm.num_free_blocks, bm.num_shared_blocks)
        if not self.in_flight:
            return []
        result = self.executor.receive()
        if self.tracer:
            self.tracer.on_receive(result.batch_id, len(result.tokens))
        return self.process_result(self.in_flight.popleft(), result)

    def process_result(self, batch: ScheduledBatch, result: SampledBatch) -> list[Request]:
        """Applies a batch's sampled tokens (and prompt log-probabilities); returns the requests that got a token."""
        assert batch.batch_id == result.batch_id, "pipeline returned batches out of order"
        for req in batch.requests:
            req.in_flight -= 1
            if req.is_finished and not req.in_flight:  # finished while in flight; its blocks were kept until now
                self.block_manager.free(req)
        for req in batch.sampled:
            req.suspect = False  # a batch that sampled it came back: its input went through every stage
        if result.prompt_logprobs is not None:
            self.outputs.add_prompt_logprobs(batch, result.prompt_logprobs)
        updated = [r for r in batch.sampled if not r.is_finished]
        if result.num_accepted is None:  # step by step: each step's token of every request
            owners = batch.sampled * batch.stage_batch.num_steps
        else:  # a request's kept drafts, then its next token; K/V past the drafts it kept is not its own
            owners = []
            for req, kept in zip(batch.sampled, result.num_accepted.tolist()):
                req.num_computed_tokens -= len(req.draft_token_ids) - kept
                self.num_draft_tokens += len(req.draft_token_ids)
                self.num_accepted_tokens += kept
                req.draft_token_ids = []
                owners += [req] * (kept + 1)
        self.num_generated_tokens += self.outputs.add_tokens(owners, result.tokens)
        return updated

    def pop_output(self, request_id: str, prompt: str | None) -> RequestOutput:
        """The finished request's output; forgets the request."""
        return self.outputs.output(request_id, prompt, [self.requests.pop(rid) for rid in self.groups.pop(request_id)])

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def inspect(self):
        assert not self.in_flight, "inspect() between generate calls only"
        try:
            reports = self.executor.inspect()
        except PipelineError as e:
            self.restart(e)
            return []
        if self.tracer:
            self.tracer.add_reports(reports)
        return reports

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.store is None:
            return
        try:
            self.store.set(comm.SHUTDOWN_KEY, "1")  # node agents on other hosts exit...
            if self.config.nnodes > 1 and self.config.distributed_executor_backend == "mp":
                # ...and say so before this process, which holds the store, goes
                self.store.wait([comm.bye_key(k) for k in range(1, self.config.nnodes)], timedelta(seconds=3))
        except Exception:
            pass


__all__ = ["LLMEngine", "PipelineError"]
