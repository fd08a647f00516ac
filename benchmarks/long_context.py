"""Decode at long contexts against this machine's memory bandwidth (issue target: 8 sequences at 4,096-token contexts
read KV and weights at >= 70% of the measured bandwidth, and reach >= 0.4x the tok/s of 256-token contexts).

The default model at PP=1 (2 threads): 8 prompts of --contexts tokens each, prefilled and cached first, then run again
for --new tokens; decode rate = tokens generated once every prompt is in, over the time they took. Bytes a decode step reads: every weight once, plus each
sequence's cached K/V in every layer. The bandwidth (256 MiB summed, same threads) is measured in the same run.

    python benchmarks/long_context.py --json benchmarks/results/long_context.json [--kv-cache-dtype int8]
"""
import argparse
import json
import time

from pipellm import LLM, SamplingParams
from pipellm.models.kv_cache import block_bytes, cache_dtype
from pipellm.observe.roofline import measure_limits

SEQS = 8


def long_prompts(context: int, seqs: int = SEQS) -> list[dict]:
    return [{"prompt_token_ids": [(17 * i + 7 * s) % 40000 + 100 for i in range(context)]} for s in range(seqs)]


def decode_tok_s(outs) -> float:
    """Tokens generated once every prompt is in (its first token out), over the time they took."""
    first = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    return sum(t > first for o in outs for t in o.metrics.token_times) / (end - first)


def decode_run(llm: LLM, context: int, new: int) -> dict:
    """The prompts' prefill first (max_tokens=1, left in the prefix cache), then the measured run, whose prompts hit
    the cache: its time is decode. Its decode rate, and the shares of it the stage spent computing and the driver
    spent on a core."""
    prompts = long_prompts(context)
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    start, busy, cpu = time.monotonic(), llm.engine.inspect()[0].busy_s, time.process_time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1 + new, temperature=0, ignore_eos=True), use_tqdm=False)
    wall = time.monotonic() - start
    return {"tok_s": decode_tok_s(outs), "stage_busy": (llm.engine.inspect()[0].busy_s - busy) / wall,
            "driver_cpu": (time.process_time() - cpu) / wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    limit = measure_limits(2, 8, 576, 1536)["read_bytes_s"]
    print(f"memory read bandwidth, 2 threads: {limit / 1e9:.1f} GB/s", flush=True)
    results = {}
    with LLM(kv_cache_dtype=args.kv_cache_dtype, kv_cache_gib=2.5) as llm:
        llm.generate("warm up", SamplingParams(max_tokens=2), use_tqdm=False)
        cfg, ecfg = llm.engine.model_config, llm.engine.config
        weights = sum(n for r in llm.engine.inspect() for _, n in r.weight_bytes)
        kv_token = block_bytes(cache_dtype(ecfg.kv_cache_dtype, ecfg.torch_dtype), ecfg.block_size, cfg.num_kv_heads,
                               cfg.head_dim) * cfg.num_layers / ecfg.block_size
        for context in args.contexts:
            start = time.perf_counter()
            r = results[context] = decode_run(llm, context, args.new)
            tok_s = r["tok_s"]
            step_bytes = weights + SEQS * (context + args.new / 2) * kv_token
            share = step_bytes * tok_s / SEQS / limit
            r.update(step_bytes=step_bytes, bandwidth_share=share)
            print(f"{SEQS} x {context} tokens: decode {tok_s:.1f} tok/s, {step_bytes / 1e6:.0f} MB a step "
                  f"({weights / 1e6:.0f} MB weights), {share:.0%} of the bandwidth; while decoding the stage computed "
                  f"{r['stage_busy']:.0%} of the time, the driver used {r['driver_cpu']:.0%} of a core "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    low, high = min(args.contexts), max(args.contexts)
    ratio = results[high]["tok_s"] / results[low]["tok_s"]
    print(f"tok/s at {high} / at {low} tokens: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "read_bytes_s": limit, "results": results, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
