"""Offline throughput on the issue's workload, every system in one run, in turns (the machine is shared and noisy).

Workload: 32 requests, prompts of 64-192 random tokens, 64 new tokens each (greedy, EOS ignored).
    python benchmarks/throughput.py [--rounds 2] [--json BENCH.json] [--partition 17,13]
Prints the median generated tok/s of each system over the rounds, and the ratios the project tracks.
"""
import argparse
import json
import statistics

from pipellm.entrypoints.bench import make_prompts, run_bench, run_hf

WORKLOAD = dict(num_prompts=32, input_len=(64, 192), output_len=64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--partition", default=None, help="layer partition for the 2-stage runs: 17,13 or auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    partition = args.partition
    if partition and partition != "auto":
        partition = [int(x) for x in partition.split(",")]
    systems = {
        "pp1_1thread": dict(pipeline_parallel_size=1, threads_per_stage=1),
        "pp1_2threads": dict(pipeline_parallel_size=1, threads_per_stage=2),
        "pp2_1thread_each": dict(pipeline_parallel_size=2, threads_per_stage=1, layer_partition=partition),
        "pp2_bf16": dict(pipeline_parallel_size=2, threads_per_stage=1, layer_partition=partition, dtype="bfloat16"),
    }
    rates = {name: [] for name in [*systems, "hf_fp32_2threads"]}
    details = {}
    for _ in range(args.rounds):
        for name, kwargs in systems.items():
            r = run_bench(**WORKLOAD, use_tqdm=False, **kwargs)
            rates[name].append(r["generated_tok_s"])
            details[name] = r
            print(f"{name:18s} {r['generated_tok_s']:7.1f} generated tok/s  bubble {r['bubble_pct']:5.1f}%  "
                  f"busy {', '.join(f'{b:.0f}%' for b in r['stage_busy_pct'])}", flush=True)
        prompts = make_prompts(WORKLOAD["num_prompts"], WORKLOAD["input_len"], 49152, 0)
        hf = run_hf(None, prompts, WORKLOAD["output_len"], "float32", 2)
        rates["hf_fp32_2threads"].append(hf["generated_tok_s"])
        print(f"{'hf_fp32_2threads':18s} {hf['generated_tok_s']:7.1f} generated tok/s", flush=True)
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratios = {
        "pp2 / pp1 (1 thread)": med["pp2_1thread_each"] / med["pp1_1thread"],
        "pp2 / pp1 (2 threads)": med["pp2_1thread_each"] / med["pp1_2threads"],
        "pp2 / hf fp32": med["pp2_1thread_each"] / med["hf_fp32_2threads"],
        "pp2 bf16 / hf fp32": med["pp2_bf16"] / med["hf_fp32_2threads"],
    }
    print("\nmedian generated tok/s:", {k: round(v, 1) for k, v in med.items()})
    for k, v in ratios.items():
        print(f"{k:24s} {v:.2f}x")
    print(f"bubble pp2: {details['pp2_1thread_each']['bubble_pct']:.1f}% (last round)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(workload=WORKLOAD, rates=rates, median=med, ratios=ratios, details=details), f, indent=2)


if __name__ == "__main__":
    main()
