"""How many KV cache blocks the stages hold: the largest counts that fit every stage's budget (kv_cache_gib, a GPU's
free memory, or num_kv_blocks), so that one block table is valid on every stage, checked against this host's memory."""
import logging
from dataclasses import dataclass

from pipellm import device
from pipellm.config import DEFAULT_KV_CACHE_GIB, EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.models.kv_cache import block_bytes, cache_dtype
from pipellm.models.linear_attention import state_bytes
from pipellm.pipeline.partition import StageLayers

log = logging.getLogger("pipellm")


@dataclass
class KVBudget:
    ring: int           # blocks a sequence's sliding-window layers cycle through; 0: they share the full blocks
    num_blocks: int     # blocks of each full-attention layer
    ring_blocks: int    # blocks of each sliding-window layer's own cache (0 without rings)
    max_model_len: int  # lowered where the model's whole context does not fit and the user did not ask for it


def window_ring(mc: ModelConfig, cfg: EngineConfig, max_model_len: int) -> int:
    """Blocks a sequence's sliding-window (or chunked) layers cycle through: a window (a chunk) of keys plus the
    longest chunk a step writes, and one more for a window that starts mid-block. 0 when no layer slides or it would
    save nothing."""
    span = mc.sliding_window or mc.attention_chunk  # Llama 4's chunked layers: at most a chunk before a step
    if not span or not any(mc.is_sliding(i) for i in range(mc.num_layers)):
        return 0
    ring = -(-(span + cfg.max_num_batched_tokens - 1) // cfg.block_size) + 1
    return ring if ring < -(-max_model_len // cfg.block_size) else 0


def kv_budget(mc: ModelConfig, cfg: EngineConfig, stages: list[StageLayers], dev: str,
              max_model_len: int) -> KVBudget:
    """The sliding layers get rings of their own only where one sequence of the whole context would not fit
    otherwise: a ring holds a long sequence's window in a few blocks, but a short sequence fills as many blocks
    either way."""
    needed = -(-max_model_len // cfg.block_size)  # one full-length sequence
    ring, ring_blocks = window_ring(mc, cfg, max_model_len), 0
    dtype = cache_dtype(cfg.kv_cache_dtype, cfg.torch_dtype)
    sizes = [block_bytes(dtype, cfg.block_size, *mc.cache_shape(i), mc.is_mla) for i in range(mc.num_layers)]
    if cfg.num_kv_blocks is not None:
        num_blocks, source, ring = cfg.num_kv_blocks, f"num_kv_blocks={cfg.num_kv_blocks}", 0
    else:
        gib = (cfg.kv_cache_gib if cfg.kv_cache_gib is not None else DEFAULT_KV_CACHE_GIB if dev == "cpu"
               else device.gpu_kv_cache_gib(dev, mc, stages, cfg.torch_dtype.itemsize, cfg.gpu_memory_utilization,
                                            cfg.nnodes))
        budget = int(gib * 2 ** 30)
        num_blocks = min(budget // max(1, stage_bytes(mc, s, sizes, 1, 1)) for s in stages)
        source = f"kv_cache_gib={gib:g}"
        if ring and num_blocks < needed:  # full-length sequences that fit with rings, on every stage
            num_seqs = min(min(budget // stage_bytes(mc, s, sizes, needed, ring) for s in stages), cfg.max_num_seqs)
            if num_seqs:
                num_blocks, ring_blocks = num_seqs * needed, num_seqs * ring
        ring = ring if ring_blocks else 0
        # More blocks than max_num_seqs full-length sequences can use is wasted memory.
        num_blocks = min(num_blocks, needed * cfg.max_num_seqs)
    if num_blocks < needed and cfg.max_model_len is None and num_blocks > 0:
        # the model's whole context does not fit: serve what does, as llama.cpp's smaller default context does
        log.warning("%s holds %d tokens, less than the model's context of %d: max_model_len lowered to %d "
                    "(give more KV cache to serve longer sequences)", source, num_blocks * cfg.block_size,
                    max_model_len, num_blocks * cfg.block_size)
        max_model_len = num_blocks * cfg.block_size
    elif num_blocks < needed:
        raise ValueError(f"{source} holds {num_blocks * cfg.block_size} tokens, fewer than one sequence of "
                         f"max_model_len={max_model_len}; give more KV cache or lower max_model_len")
    if dev == "cpu" and cfg.nnodes == 1:
        # without rings a sliding layer's cache holds num_blocks too
        need = sum(stage_bytes(mc, s, sizes, num_blocks, ring_blocks or num_blocks) for s in stages)
        # linear-attention layers' states, grown as sequences run: at most max_num_seqs of them, and as many saved
        # for prefix caching
        if mc.keeps_states:
            rows = cfg.max_num_seqs * (2 if cfg.enable_prefix_caching else 1)
            need += mc.num_linear_layers * rows * state_bytes(mc, cfg.torch_dtype)
        check_host_memory(source, need, num_blocks, len(stages))
    return KVBudget(ring, num_blocks, ring_blocks, max_model_len)


def stage_bytes(mc: ModelConfig, stage: StageLayers, sizes: list[int], full: int, ring: int) -> int:
    """Bytes of a stage's layers' caches of full blocks a full-attention layer and ring a sliding one, sizes[i] the
    bytes of a block of layer i; none for a linear-attention layer (a state per sequence) nor an MLP one."""
    return sum(sizes[i] * (ring if mc.is_sliding(i) else full) for i in range(stage.start, stage.end)
               if mc.has_kv_cache(i))


def check_host_memory(source: str, need: int, num_blocks: int, num_stages: int) -> None:
    """Refuses KV caches of `need` bytes on this host past the memory it has available, before any stage fills
    them."""
    avail = device.host_memory_available()
    if avail is None or need <= 0.9 * avail:  # the rest for weights and activations
        return
    room = 0.8 * avail
    fix = (f"give num_kv_blocks={int(room / need * num_blocks)} or fewer" if source.startswith("num_kv_blocks")
           else f"give kv_cache_gib={room / num_stages / 2 ** 30:.3f} or less (a stage's)")
    raise ValueError(f"{source}: the KV caches of this host's {num_stages} stage(s) would take "
                     f"{need / 2 ** 30:.3f} GiB, more than 90% of the {avail / 2 ** 30:.3f} GiB of memory it has "
                     f"available (the rest is for weights and activations); {fix}, or lower max_num_seqs or "
                     "max_model_len")
