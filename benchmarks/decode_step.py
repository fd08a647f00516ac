"""One decode step of the default model in one process (PP=1, every layer, no engine around it): the layers' own
forward against the fused path (models/fused.py: one kernel call for the stage's layers), in alternating rounds of
the same run. `python benchmarks/decode_step.py [--seqs 1] [--context 64] [--threads 2]`"""
import argparse
import json
import statistics
import time

import torch

from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import cached_gguf_folder, load_gguf_stage_weights
from pipellm.model_config import ModelConfig
from pipellm.models import fused
from pipellm.models.attention import AttentionMetadata
from pipellm.models.kv_cache import KVCache
from pipellm.models.layers import transpose_linears
from pipellm.models.registry import build_stage_model
from pipellm.pipeline.partition import StageLayers

BLOCK = 16


def default_model_stage() -> tuple[ModelConfig, torch.nn.Module]:
    """The default model's whole stack as one stage, its compact weights loaded and laid out as a stage holds them."""
    folder = cached_gguf_folder(default_model_path())
    cfg = ModelConfig.from_pretrained(folder)
    model = build_stage_model(cfg, StageLayers(0, 0, cfg.num_layers, True, True), meta=True)
    load_gguf_stage_weights(model, folder, torch.float32)
    transpose_linears(model)
    return cfg, model.eval()


def random_caches(cfg: ModelConfig, num_blocks: int, gen: torch.Generator) -> list[KVCache]:
    """An fp32 KV cache a layer, filled with random values."""
    caches = [KVCache.allocate(num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32)
              for _ in range(cfg.num_layers)]
    for c in caches:
        c.k.normal_(generator=gen)
        c.v.normal_(generator=gen)
    return caches


def decode_inputs(cfg: ModelConfig, seqs: int, context: int, gen: torch.Generator) -> tuple:
    """(ids, positions, meta, caches) of a decode step of seqs sequences at the given context, their blocks
    scattered over random caches."""
    width = context // BLOCK + 1
    caches = random_caches(cfg, seqs * width, gen)
    tables = torch.randperm(seqs * width, generator=gen).int().view(seqs, width)
    positions = torch.full((seqs,), context)
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    meta = AttentionMetadata.for_layers([False] * cfg.num_layers, None, positions,
                                        torch.ones(seqs, dtype=torch.long), positions + 1, tables, slots, BLOCK)
    ids = torch.randint(0, cfg.vocab_size, (seqs,), generator=gen)
    return ids, positions, meta, caches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg, model = default_model_stage()
    ids, positions, meta, caches = decode_inputs(cfg, args.seqs, args.context, torch.Generator().manual_seed(0))
    fused_applies = fused.applies
    times = {"layers": [], "fused": []}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for path in times:
                fused.applies = fused_applies if path == "fused" else (lambda x, meta: False)
                model(ids, positions, meta, caches)  # warm-up
                for _ in range(args.steps):
                    start = time.perf_counter()
                    model(ids, positions, meta, caches)
                    times[path].append(time.perf_counter() - start)
    fused.applies = fused_applies
    result = {path: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3} for path, t in times.items()}
    result["speedup_median"] = result["layers"]["median_ms"] / result["fused"]["median_ms"]
    print(json.dumps(vars(args) | result))


if __name__ == "__main__":
    main()
