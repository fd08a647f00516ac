"""layer_partition="auto": time one decoder layer, the embedding and the LM head on this machine (once, cached
on disk), then split the layers so that the slowest stage is as fast as it can be."""
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from pipellm import kernels
from pipellm.config import EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache, cache_dtype
from pipellm.models.linear_attention import layer_cache
from pipellm.models.layers import transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.quant.linear import set_int8_activations
from pipellm.quant.rtn import quantize_linears
from pipellm.sampler import greedy_ids
from pipellm.pipeline.partition import StageLayers, even_partition

CONTEXT = 128  # tokens of context each profiled sequence attends over


@dataclass
class LayerCosts:
    """Seconds to produce num_tokens generated tokens, prefill of their prompts included."""
    layer_s: float   # one decoder layer
    embed_s: float   # the embedding (first stage)
    head_s: float    # final norm + LM head (last stage); only sampled rows pass through it
    num_tokens: int  # generated tokens: one decode micro-batch


def profile_costs(model_config: ModelConfig, engine_config: EngineConfig, repeats: int = 5,
                  compact: bool = False) -> LayerCosts:
    """Times a decode micro-batch and a prefill chunk (random weights of the model's shapes time the same as
    the real ones; compact: held as 8-bit codes, as a stage holds compact weights), then weighs them by
    engine_config.auto_partition_prompt_ratio prompt tokens per generated token: the LM head, the heaviest single
    op, runs on generated tokens only."""
    raw = _profile_raw(model_config, engine_config, repeats, compact)
    ratio, n = engine_config.auto_partition_prompt_ratio, raw["num_tokens"]
    prefill_per_token = raw["layer_prefill_s"] / raw["chunk"]
    return LayerCosts(raw["layer_decode_s"] + ratio * n * prefill_per_token,
                      raw["embed_s"] * (1 + ratio), raw["head_s"], n)


def _profile_raw(model_config: ModelConfig, engine_config: EngineConfig, repeats: int, compact: bool) -> dict:
    num_tokens = max(1, min(engine_config.max_num_seqs, 32) // engine_config.pipeline_parallel_size)
    key = ["v6", asdict(model_config), engine_config.dtype, engine_config.kv_cache_dtype, engine_config.num_threads,
           num_tokens, engine_config.max_num_batched_tokens, compact, engine_config.int8_activations,
           *_machine_key(), _kernels_build()]
    return _cached(key, lambda: _measure(model_config, engine_config, num_tokens, repeats, compact))


def _machine_key() -> list:
    """What the timings depend on besides the settings: a VM may give every CPU kind the same model name."""
    isa = sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"})
    return [torch.__version__, kernels.cpuinfo("model name"), isa]


def _kernels_build() -> str:
    """Which build of our kernels a stage runs (the one this process loaded), and which of its instruction sets:
    each times differently."""
    ops = kernels.load()
    return (os.path.basename(ops.__file__) if ops else "none") + os.environ.get("PIPELLM_ISA", "")


def _cached(key: list, measure) -> dict:
    """measure()'s result, kept on disk under the key: measured once per machine and setting."""
    cache_dir = os.path.join(os.environ.get("PIPELLM_CACHE_DIR") or os.path.expanduser("~/.cache/pipellm"),
                             "profile")
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, name + ".json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    raw = measure()
    os.makedirs(cache_dir, exist_ok=True)
    with open(path + f".{os.getpid()}.tmp", "w") as f:
        json.dump(raw, f)
    os.replace(path + f".{os.getpid()}.tmp", path)
    return raw


def auto_dtype(num_threads: int, compact: bool) -> tuple[str, str]:
    """dtype="auto": (the dtype, why). float32 unless this CPU runs bf16 matmul faster, measured once and cached."""
    if compact:
        why = "compact weights: the kernels take fp32 activations"
        if (ops := kernels.load()) is not None and ops.best_isa() == "amx":  # the tiles our kernels would use
            why += "; this CPU has AMX tiles, where dtype=\"bfloat16\" runs batches about 2x faster (fp32 keeps HF's " \
                   "fp32 greedy output)"
        return "float32", why
    if not kernels.has_bf16_matmul():
        return "float32", "this CPU has no bf16 instructions"
    key = ["dtype-v1", *_machine_key(), num_threads]
    ratio = _cached(key, lambda: _bf16_speedup(num_threads))["ratio"]
    return ("bfloat16" if ratio > 1.1 else "float32"), f"bf16 matmul measured at {ratio:.2f}x the speed of fp32"


@torch.inference_mode()
def _bf16_speedup(num_threads: int) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):  # a decode-sized and a prefill-sized matmul of a small model
            x1, x2, w = torch.randn(8, 1024, dtype=dtype), torch.randn(256, 1024, dtype=dtype), torch.randn(
                1024, 2048, dtype=dtype)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                x1 @ w, x2 @ w
                best = min(best, time.perf_counter() - start)
            times[dtype] = best
        return {"ratio": times[torch.float32] / times[torch.bfloat16]}
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def _measure(cfg: ModelConfig, ecfg: EngineConfig, num_tokens: int, repeats: int, compact: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(ecfg.num_threads)  # as a stage will run
    try:
        # each kind of layer timed once, weighed by how many the model has: with experts or a dense MLP (DeepSeek's
        # first layers, Jamba's every other); linear-attention, Mamba or full-attention (Qwen3-Next's, Jamba's;
        # Nemotron-H's MLP ones too); sliding and full layers as one kind where their heads are alike (Gemma 4's not)
        kinds = [(cfg.layer_types[i] if cfg.keeps_states else "", cfg.is_moe(i), cfg.attention_shape(i))
                 for i in range(cfg.num_layers)]
        timed = {kind: _time_layer(cfg, ecfg, kinds.index(kind), num_tokens, repeats, compact)
                 for kind in dict.fromkeys(kinds)}
        return {**timed[kinds[0]], **{key: sum(kinds.count(kind) / len(kinds) * t[key] for kind, t in timed.items())
                                      for key in ("layer_decode_s", "layer_prefill_s")}}
    finally:
        torch.set_num_threads(threads)


def _time_layer(cfg: ModelConfig, ecfg: EngineConfig, layer: int, num_tokens: int, repeats: int,
                compact: bool) -> dict:
    """A decode micro-batch and a prefill chunk through the model's layer `layer` alone; the embedding and head."""
    model = build_stage_model(cfg, StageLayers(0, layer, layer + 1, True, True)).to(ecfg.torch_dtype)
    if compact:  # a stage multiplies by compact weights with our kernels: time those, not fp32
        quantize_linears(model, "int8")
        set_int8_activations(model, ecfg.int8_activations)
    transpose_linears(model)
    bs = ecfg.block_size
    blocks_per_seq = -(-CONTEXT // bs)
    kv_dtype = cache_dtype(ecfg.kv_cache_dtype, ecfg.torch_dtype)

    def cache(blocks: int):  # the layer's (a linear-attention one's: its state; an MLP one's: none)
        return layer_cache(cfg, layer, ecfg.torch_dtype, "cpu",
                           partial(KVCache.allocate, blocks, bs, *cfg.cache_shape(layer), kv_dtype, shared=cfg.is_mla))
    caches = [cache(num_tokens * blocks_per_seq)]
    tables = torch.arange(num_tokens * blocks_per_seq, dtype=torch.int32).view(num_tokens, blocks_per_seq)
    positions = torch.full((num_tokens,), CONTEXT - 1)
    slots = tables[:, -1].long() * bs + (CONTEXT - 1) % bs
    is_sliding = [cfg.is_sliding(layer)]
    meta = AttentionMetadata.for_layers(is_sliding, cfg.sliding_window, positions,
                                        torch.ones(num_tokens, dtype=torch.long),
                                        torch.full((num_tokens,), CONTEXT), tables, slots, bs,
                                        attention_chunk=cfg.attention_chunk)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,))
    hidden = torch.randn(num_tokens, cfg.hidden_size, dtype=ecfg.torch_dtype)
    embed = lambda: model.embed(ids, positions)  # noqa: E731
    run_layer = lambda: model.run_layers(hidden, positions, meta, caches)  # noqa: E731
    decode_s = best_of(run_layer, repeats)
    # A prefill chunk of one sequence, as big as a step's token budget.
    chunk = min(ecfg.max_num_batched_tokens, CONTEXT * 4, cfg.max_position_embeddings)
    blocks = -(-chunk // bs)
    pos = torch.arange(chunk)
    pmeta = AttentionMetadata.for_layers(is_sliding, cfg.sliding_window, pos, torch.tensor([chunk]),
                                         torch.tensor([chunk]), torch.arange(blocks, dtype=torch.int32)[None],
                                         pos, bs, attention_chunk=cfg.attention_chunk)
    x = torch.randn(chunk, cfg.hidden_size, dtype=ecfg.torch_dtype)
    prefill_caches = [cache(blocks)]
    prefill = lambda: model.run_layers(x, pos, pmeta, prefill_caches)  # noqa: E731

    def head():  # greedy picks, as the last stage makes them
        ids = model.greedy_ids(hidden)
        return greedy_ids(model.compute_logits(hidden)) if ids is None else ids
    return dict(layer_decode_s=decode_s, layer_prefill_s=best_of(prefill, max(1, repeats // 2)), chunk=chunk,
                embed_s=best_of(embed, repeats), num_tokens=num_tokens, head_s=best_of(head, repeats))


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def stage_times(sizes: list[int], costs: LayerCosts) -> list[float]:
    return [stage_times_of(i, n, i == len(sizes) - 1, costs) for i, n in enumerate(sizes)]


def balanced_partition(num_layers: int, num_stages: int, costs: LayerCosts) -> list[int]:
    """The contiguous split (every stage at least one layer) whose slowest stage is fastest (dynamic
    programming over stage count and layers placed)."""
    inf = float("inf")

    def cost(stage: int, start: int, end: int) -> float:
        return stage_times_of(stage, end - start, end == num_layers, costs)

    # best[k][i]: the slowest of stages 0..k when they hold layers [0, i); choice[k][i]: where stage k starts.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    choice = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for i in range(1, num_layers + 1):
        best[0][i] = cost(0, 0, i)
    for k in range(1, num_stages):
        for i in range(k + 1, num_layers + 1):
            for j in range(k, i):  # stage k holds [j, i); later starts (bigger earlier stages) win ties
                slowest = max(best[k - 1][j], cost(k, j, i))
                if slowest <= best[k][i]:
                    best[k][i], choice[k][i] = slowest, j
    sizes, end = [], num_layers
    for k in range(num_stages - 1, 0, -1):
        start = choice[k][end]
        sizes.append(end - start)
        end = start
    return [end] + sizes[::-1]


def stage_times_of(stage: int, num_layers: int, is_last: bool, costs: LayerCosts) -> float:
    return num_layers * costs.layer_s + (costs.embed_s if stage == 0 else 0.0) + (costs.head_s if is_last else 0.0)


def describe_choice(num_layers: int, num_stages: int, costs: LayerCosts) -> str:
    even = even_partition(num_layers, num_stages)
    auto = balanced_partition(num_layers, num_stages, costs)
    fmt = lambda sizes: f"{sizes} (stage ms: " + ", ".join(  # noqa: E731
        f"{t * 1e3:.1f}" for t in stage_times(sizes, costs)) + ")"
    return (f"auto partition {fmt(auto)}; even {fmt(even)}; per {costs.num_tokens} generated tokens, their prompts' "
            "prefill included")
