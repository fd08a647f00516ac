"""KV memory of sliding-window layers with and without their rings of blocks, on Gemma 3 270M (15 of 18 layers
slide over 512 tokens). A KV budget too small for one 32,768-token sequence without rings, against
one that holds it without them; the same long prompt through both: the KV bytes a stage holds, the time, and
whether the greedy output stays the same. Writes sliding_window_kv.json.

    python benchmarks/sliding_window_kv.py [--prompt-tokens 6000] [--kv-cache-gib 0.25] [--no-ring-kv-cache-gib 1.2]
"""
import argparse
import json
import time

from pipellm import LLM, SamplingParams


def run(args, kv_cache_gib: float) -> dict:
    with LLM("gemma-3-270m", kv_cache_gib=kv_cache_gib, pipeline_parallel_size=args.pp) as llm:
        engine = llm.engine
        prompt = {"prompt_token_ids": [2] + [(17 * i + 300) % 200000 + 1000 for i in range(args.prompt_tokens - 1)]}
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
        elapsed = time.perf_counter() - start
        reports = engine.inspect()
        return {"kv_cache_gib": kv_cache_gib, "window_ring_blocks": engine.window_ring,
                "full_layer_blocks": engine.num_blocks, "window_layer_blocks": engine.num_window_blocks,
                "max_model_len": engine.max_model_len, "tokens_that_fit": engine.num_blocks * engine.config.block_size,
                "kv_cache_bytes_per_stage": [r.kv_cache_bytes for r in reports],
                "seconds": elapsed, "token_ids": out.outputs[0].token_ids}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--no-ring-kv-cache-gib", type=float, default=1.2)  # one 32,768-token sequence fits: no rings
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    # rings come when one sequence of the whole context would not fit without them
    ring, no_ring = run(args, args.kv_cache_gib), run(args, args.no_ring_kv_cache_gib)
    for name, r in (("rings", ring), ("no rings", no_ring)):
        print(f"{name:8s}: max_model_len {r['max_model_len']}, {r['tokens_that_fit']:6d} tokens fit in "
              f"{r['kv_cache_gib']} GiB a stage "
              f"(ring {r['window_ring_blocks']} blocks), KV held {sum(r['kv_cache_bytes_per_stage']) / 2**20:.0f} MiB, "
              f"{args.prompt_tokens}-token prompt + 16 tokens in {r['seconds']:.1f} s")
    print(f"KV bytes held, no rings / rings: {sum(no_ring['kv_cache_bytes_per_stage']) / sum(ring['kv_cache_bytes_per_stage']):.2f}x; "
          f"time, rings / no rings: {ring['seconds'] / no_ring['seconds']:.2f}; "
          f"same greedy tokens: {ring['token_ids'] == no_ring['token_ids']}")
    with open("sliding_window_kv.json", "w") as f:
        json.dump({"args": vars(args), "rings": ring, "no_rings": no_ring}, f, indent=1)


if __name__ == "__main__":
    main()
