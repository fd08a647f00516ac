"""The default model's one-call decode step with its weights on 2 MB pages (as a stage holds them:
models/huge_pages.py) against the same weights left on 4 KB pages, in alternating rounds of one process, over the
same KV caches. `python benchmarks/weight_pages.py [--seqs 1,8,16,32] [--context 160] [--threads 1]`"""
import argparse
import json
import statistics
import time

import torch
from decode_step import decode_inputs, default_model_stage

from pipellm.models import huge_pages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="1,8,16,32", help="sequences a step, comma-separated")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg, small = default_model_stage()
    _, huge = default_model_stage()
    moved = huge_pages.weights_on_huge_pages(huge)  # first: the caches below must not take the cheap 2 MB pages
    print(f"weights moved to 2 MB pages: {moved >> 20} MB")
    for seqs in (int(s) for s in args.seqs.split(",")):
        ids, positions, meta, caches = decode_inputs(cfg, seqs, args.context, torch.Generator().manual_seed(0))
        times = {"4 KB": [], "2 MB": []}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, model in (("4 KB", small), ("2 MB", huge)):
                    model(ids, positions, meta, caches)  # warm-up
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        model(ids, positions, meta, caches)
                        times[name].append(time.perf_counter() - start)
        medians = {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}
        print(json.dumps({"seqs": seqs, "context": args.context, "threads": args.threads, "median_ms": medians,
                          "speedup": round(medians["4 KB"] / medians["2 MB"], 3)}))


if __name__ == "__main__":
    main()
