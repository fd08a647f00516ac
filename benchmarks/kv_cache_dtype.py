"""kv_cache_dtype: what "bfloat16" and "int8" gain in capacity and long-context decode speed over "auto" (float32 here),
in one run. Accuracy: benchmarks/perplexity.py.

1. One layer's decode attention (default model's heads: 9 query, 3 KV, head_dim 64; 1 thread), 16 sequences at
   --context tokens, K/V read in place by our kernel from each cache dtype.
2. The default model end to end (PP=1, 2 threads): --seqs prompts of --context tokens, then --new tokens each;
   decode rate = tokens generated once every prompt is in, over the time they took. Capacity: tokens the engine's
   blocks hold with kv_cache_gib=1.

    python benchmarks/kv_cache_dtype.py --json benchmarks/results/kv_cache_dtype.json
"""
import argparse
import json
import time

import torch
from long_context import decode_tok_s, long_prompts  # benchmarks/ itself: they run as scripts

from pipellm import LLM, SamplingParams
from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.kv_cache import KVCache

DTYPES = {"auto": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def attention_ms(kv: str, context: int, seqs: int = 16, repeats: int = 20) -> float:
    gen = torch.Generator().manual_seed(0)
    width = -(-context // BLOCK)
    cache = KVCache.allocate(seqs * width, BLOCK, KV_HEADS, HEAD_DIM, DTYPES[kv])
    tables = torch.randperm(seqs * width, generator=gen).view(seqs, width).int()
    slots = (tables.reshape(-1).long()[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)  # every slot, filled
    cache.write(slots, torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen),
                torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen))
    positions = torch.full((seqs,), context - 1)
    last = tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    meta = AttentionMetadata.build(positions, torch.ones(seqs, dtype=torch.long), torch.full((seqs,), context),
                                   tables, last, BLOCK)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
    k, v = torch.randn(seqs, KV_HEADS, HEAD_DIM, generator=gen), torch.randn(seqs, KV_HEADS, HEAD_DIM, generator=gen)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        paged_attention(q, k, v, cache, meta, HEAD_DIM ** -0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def end_to_end(kv: str, context: int, seqs: int, new: int) -> dict:
    """Decode rate: the tokens generated after the last prompt's prefill, over the time they took."""
    prompts = long_prompts(context, seqs)
    with LLM(pipeline_parallel_size=1, kv_cache_dtype=kv) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        start = time.monotonic()  # the clock of the requests' metrics
        outs = llm.generate(prompts, SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        capacity = llm.engine.num_blocks * llm.engine.config.block_size
    return {"decode_tok_s": decode_tok_s(outs), "prefill_s": max(o.metrics.first_token_time for o in outs) - start,
            "capacity_tokens": capacity}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    attention = {kv: attention_ms(kv, args.context) for kv in DTYPES}
    torch.set_num_threads(threads)
    for kv, ms in attention.items():
        print(f"decode attention, 16 x {args.context} tokens, 1 layer, 1 thread, kv {kv}: {ms:.2f} ms "
              f"({attention['auto'] / ms:.2f}x auto)", flush=True)
    model = {}
    for kv in DTYPES:
        model[kv] = r = end_to_end(kv, args.context, args.seqs, args.new)
        print(f"default model, {args.seqs} x {args.context} tokens + {args.new}, kv {kv}: decode "
              f"{r['decode_tok_s']:.1f} tok/s ({r['decode_tok_s'] / model['auto']['decode_tok_s']:.2f}x auto), "
              f"prefill {r['prefill_s']:.1f} s, holds {r['capacity_tokens']} tokens in 1 GiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "attention_ms": attention, "model": model}, f, indent=2)


if __name__ == "__main__":
    main()
