"""CUDA graphs for a GPU stage's decode steps. A step of decodes on a GPU is held by the host that launches its
kernels: an H200 ran ~1,300 launches a step of the default model and was busy 12% of the time. A graph replays a
step's kernels in one launch.

A graph has fixed shapes and addresses, so a step is padded to the next of a few batch sizes and context lengths,
its inputs are copied into buffers the graphs read, and the rows of padding write their K/V to a block of their own
(the caches' last, which the driver never hands out). A shape is captured the first time a step needs it. Steps with
prefill chunks, drafts or probes, and contexts past MAX_CONTEXT_TO_CAPTURE, stay eager, as does every step under
enforce_eager (vLLM's name)."""
import logging
import os
from collections import OrderedDict

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipellm.models.attention import AttentionMetadata, DecodeGroup
from pipellm.models.kv_cache import KVCache

log = logging.getLogger("pipellm")
BATCH_SIZES = [1, 2, 4] + list(range(8, 513, 8))  # vLLM's capture sizes
MAX_CONTEXT_TO_CAPTURE = 8192  # vLLM's max_seq_len_to_capture
# graphs a stage keeps (each holds its ~1,300 kernels' launch parameters): contexts that grow through many padded
# lengths, at many batch sizes, would otherwise add graphs for as long as a server runs
MAX_GRAPHS = 64
# SDPA's kernels that take any mask inside a capture (cuDNN's plans per shape at capture time; not relied on)
CAPTURE_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# "1": a CPU stage runs the graphs' padded steps, eagerly (tests of the stage's use of this file)
ON_CPU_ENV = "PIPELLM_DECODE_GRAPHS_ON_CPU"


def padded_batch(num_seqs: int) -> int:
    return next(b for b in BATCH_SIZES if b >= num_seqs)


def padded_blocks(num_blocks: int) -> int:
    """Blocks of context a graph attends over: powers of two up to 32, then multiples of 32 (a step reads at most
    ~1/32 more than it needs past 32 blocks)."""
    return 1 << max(0, num_blocks - 1).bit_length() if num_blocks <= 32 else -(-num_blocks // 32) * 32


def supported(model_config, engine_config, dev: torch.device, num_window_blocks: int) -> str | None:
    """Why a stage's decode steps cannot replay graphs, or None where they can."""
    cfg = model_config
    if dev.type != "cuda" and os.environ.get(ON_CPU_ENV) != "1":
        return "not a GPU"
    if engine_config.enforce_eager:
        return "enforce_eager"
    if cfg.num_experts:
        return "mixture-of-experts layers route tokens by data (their shapes change per step)"
    if cfg.rope.rope_type in ("dynamic", "longrope"):
        return f"{cfg.rope.rope_type} rotary changes with each sequence's length"
    if cfg.rope.llama4_scaling_beta or cfg.nope_temperature:
        return "queries scaled by their position (Llama 4's temperature) past a length read from the data"
    if cfg.keeps_states:
        return "linear-attention layers keep a state per sequence, in rows read from the data"
    if cfg.attention_chunk:
        return "chunked attention layers' blocks start where each sequence's chunk does"
    if engine_config.enable_lora:
        return "LoRA adapters add products per slot, for rows read from the data"
    if engine_config.kv_cache_dtype == "int8":
        return "int8 KV caches rescale blocks by data"
    if num_window_blocks:
        return "sliding-window layers keep rings of blocks"
    return None


class DecodeGraphs:
    """A stage's captured decode steps, one per (padded batch, padded blocks), and the buffers they read."""

    def __init__(self, model, kv_caches: list[KVCache], is_sliding: list[bool], sliding_window: int | None,
                 block_size: int, max_num_seqs: int, capture: bool = True):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.is_sliding, self.window = is_sliding, sliding_window or 0
        self.scratch = kv_caches[0].k.shape[0] - 1  # the padding rows' block
        self.max_batch = padded_batch(min(max_num_seqs, BATCH_SIZES[-1]))
        self.max_blocks = padded_blocks(-(-MAX_CONTEXT_TO_CAPTURE // block_size))
        dev = kv_caches[0].k.device
        # ids, positions, seq_lens, slots [B] each, then block tables [B, N]: one copy from the host a step
        self.ints = torch.zeros(self.max_batch * (4 + self.max_blocks), dtype=torch.int64, device=dev)
        self.hidden = None  # [max_batch, hidden] the input of a stage after the first, made at its first step
        self.capture = capture  # False: the same padded steps, run eagerly (the CPU's tests of this file)
        # (padded batch, padded blocks) -> (graph, its output), least recently used first
        self.graphs: OrderedDict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = \
            OrderedDict()
        self.pool = None
        self.steps = 0  # steps run through here
        self.failed: str | None = None  # why a capture failed: every later step runs eagerly

    def applies(self, query_lens: np.ndarray, seq_lens: np.ndarray) -> bool:
        return (self.failed is None and 0 < len(query_lens) <= self.max_batch and bool((query_lens == 1).all())
                and int(seq_lens.max()) <= MAX_CONTEXT_TO_CAPTURE)

    def run(self, x: np.ndarray | torch.Tensor, positions: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray, slot_mapping: np.ndarray) -> torch.Tensor:
        """One decode step: x the token ids [B] (first stage) or hidden states [B, hidden] on the device. Returns
        hidden [B, hidden], a tensor of its own."""
        num_seqs, bs = len(positions), self.block_size
        b, n = padded_batch(num_seqs), padded_blocks(-(-int(seq_lens.max()) // bs))
        host = np.zeros(b * (4 + n), np.int64)
        ids, pos, lens, slots = (host[i * b:i * b + num_seqs] for i in range(4))
        if isinstance(x, np.ndarray):
            ids[:] = x
        pos[:], lens[:], slots[:] = positions, seq_lens, slot_mapping
        host[2 * b + num_seqs:3 * b] = 1                                         # padding: a context of one key,
        host[3 * b + num_seqs:4 * b] = self.scratch * bs                         # in the scratch block
        tables = host[4 * b:].reshape(b, n)                                      # [b, n]
        width = min(n, block_tables.shape[1])
        tables[:num_seqs, :width] = block_tables[:, :width]
        tables[num_seqs:] = self.scratch
        self.ints[:len(host)].copy_(torch.from_numpy(host))
        self.steps += 1
        if isinstance(x, torch.Tensor):
            if self.hidden is None:
                self.hidden = torch.zeros(self.max_batch, x.shape[1], dtype=x.dtype, device=x.device)
            self.hidden[:num_seqs].copy_(x)
        graph, out = self._graph(b, n)
        if graph is None:  # not capturing (the CPU's tests), or a capture failed
            return self._forward(b, n)[:num_seqs].clone()
        graph.replay()
        return out[:num_seqs].clone()  # the next replay overwrites out, maybe while this one is being sent

    def _graph(self, b: int, n: int) -> tuple:
        """The graph of this shape and its output, captured if new (the least recently used one goes past
        MAX_GRAPHS); (None, None) where the step runs eagerly."""
        if (b, n) in self.graphs:
            self.graphs.move_to_end((b, n))
            return self.graphs[b, n]
        if len(self.graphs) == MAX_GRAPHS:
            self.graphs.popitem(last=False)
        try:
            self.graphs[b, n] = self._capture(b, n) if self.capture else (None, None)
        except RuntimeError as e:
            # an op a capture refuses (a family not checked on a GPU): this step and every later one run eagerly
            self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.warning("decode steps run eagerly from now on: capturing a CUDA graph failed: %s", self.failed)
            return None, None
        return self.graphs[b, n]

    def _capture(self, b: int, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # a run before the capture makes cuBLAS's handles and the allocator's blocks, which a capture cannot; it
        # writes the step's K/V, which the replay writes again, the same values to the same slots
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), sdpa_kernel(CAPTURE_ATTENTION_BACKENDS):
            self._forward(b, n)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # shared: the graphs run one at a time
        graph = torch.cuda.CUDAGraph()
        # thread_local: the heartbeat and NCCL's watchdog threads may call CUDA while this thread captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"), \
                sdpa_kernel(CAPTURE_ATTENTION_BACKENDS):
            out = self._forward(b, n)
        return graph, out

    def _forward(self, b: int, n: int) -> torch.Tensor:
        """The model over the buffers' first b rows and n blocks: the ops a graph records."""
        ids, positions, seq_lens, slots = (self.ints[i * b:(i + 1) * b] for i in range(4))
        tables = self.ints[4 * b:4 * b + b * n].view(b, n)                       # [b, n]
        key_pos = torch.arange(n * self.block_size, device=seq_lens.device)

        def view(window: int) -> AttentionMetadata:
            mask = key_pos[None, :] < seq_lens[:, None]                          # [b, K]
            if window:
                mask &= key_pos[None, :] >= seq_lens[:, None] - window
            group = DecodeGroup(None, tables, seq_lens, window, self.block_size, mask[:, None, None, :])
            return AttentionMetadata(slots, group, [], torch.ones_like(seq_lens), seq_lens)

        full = view(0) if not all(self.is_sliding) or not self.is_sliding else None
        local = view(self.window) if any(self.is_sliding) else None
        meta = full or local
        meta.local = local
        x = ids if self.model.stage.is_first else self.hidden[:b]
        return self.model(x, positions, meta, self.kv_caches)
