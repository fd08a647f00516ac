"""Paged attention of one layer, by kind of step: a 512-token prefill chunk and 15 decodes together, against each
alone (the default model's heads: 9 query heads, 3 KV heads, head_dim 64; 1 thread). Prints and saves JSON.

    python benchmarks/attention_step.py --json benchmarks/results/attention_step.json
"""
import argparse
import json
import time

import torch

from pipellm.models.attention import AttentionMetadata, paged_attention
from pipellm.models.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_step(chunk: int, chunk_start: int, decode_contexts: list[int], num_blocks: int, gen: torch.Generator):
    """(q, k, v, meta) for one step: optionally a prefill chunk of `chunk` new tokens after `chunk_start` cached ones,
    then one decode per entry of decode_contexts (its context length after this step). Blocks are shuffled."""
    query_lens, seq_lens = [], []
    if chunk:
        query_lens.append(chunk)
        seq_lens.append(chunk_start + chunk)
    for ctx in decode_contexts:
        query_lens.append(1)
        seq_lens.append(ctx)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-s // BLOCK) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    positions, slots = [], []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        blocks = [free.pop() for _ in range(-(-s // BLOCK))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(s - q, s):
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
    T = len(positions)
    meta = AttentionMetadata.build(torch.tensor(positions), torch.tensor(query_lens), torch.tensor(seq_lens), tables,
                                   torch.tensor(slots), BLOCK)
    q = torch.randn(T, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, meta


def time_step(step, cache: KVCache, repeats: int) -> float:
    q, k, v, meta = step
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        paged_attention(q, k, v, cache, meta, HEAD_DIM ** -0.5)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode-context", type=int, default=256, help="context of each decode")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 2048
    cache = KVCache(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen),
                    torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen))
    decodes = [args.decode_context] * 15
    steps = {"mixed": make_step(512, 0, decodes, num_blocks, gen), "chunk": make_step(512, 0, [], num_blocks, gen),
             "decodes": make_step(0, 0, decodes, num_blocks, gen)}
    for _ in range(3):  # warm-up
        for step in steps.values():
            time_step(step, cache, 1)
    ms = {name: 1e3 * time_step(step, cache, args.repeats) for name, step in steps.items()}
    ratio = ms["mixed"] / (ms["chunk"] + ms["decodes"])
    print(f"one layer's attention, 1 thread: chunk of 512 + 15 decodes at {args.decode_context} tokens: "
          f"{ms['mixed']:.2f} ms; chunk alone {ms['chunk']:.2f} ms; decodes alone {ms['decodes']:.2f} ms; "
          f"mixed / (chunk + decodes) = {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": ms, "ratio": ratio, "decode_context": args.decode_context}, f, indent=2)


if __name__ == "__main__":
    main()
