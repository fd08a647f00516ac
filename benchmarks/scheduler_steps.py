"""Decode scheduling on the default model, in one run: several decode steps a batch (num_scheduler_steps) against one,
and, at one step, the stage in the driver's process (the default at PP=1) against a stage process with async
scheduling ("steps1_mp") and without ("steps1_sync"). Measures
single-stream decode (as decode_latency.py: 127 / (t(128) - t(1))), with fp32 and 8-bit activations, and at PP=2;
llama.cpp on the same GGUF file and threads when given a Python that has llama-cpp-python; and the 32-request
throughput workload at PP=1.
    python benchmarks/scheduler_steps.py [--steps 1,8] [--rounds 3] [--llama-cpp-python PYTHON] [--json out.json]
Each round starts every engine afresh, one at a time, in a rotated order (a driver process's first engine decoded
slower than later ones here); the median round is reported.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from decode_latency import decode_rate, pipellm_generator

from pipellm import LLM
from pipellm.entrypoints.bench import run_bench
from pipellm.loader.default_model import default_model_path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="1,8", help="num_scheduler_steps values, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-throughput", action="store_true", help="single-stream decode only")
    parser.add_argument("--llama-cpp-python", default=None, help="a Python interpreter that has llama_cpp")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gguf_file = default_model_path()
    steps = list(map(int, args.steps.split(",")))
    systems = [(f"steps{k}" + ("_int8" if int8 else ""), dict(num_scheduler_steps=k, int8_activations=int8))
               for k in steps for int8 in (False, True)]
    if 1 in steps:
        mp = dict(num_scheduler_steps=1, int8_activations=False, distributed_executor_backend="mp")
        systems += [("steps1_mp", mp), ("steps1_sync", mp | dict(async_scheduling=False))]
    systems += [(f"pp2_steps{k}", dict(num_scheduler_steps=k, pipeline_parallel_size=2)) for k in steps]
    if args.llama_cpp_python:
        systems.append(("llama_cpp", None))
    llama_cmd = [args.llama_cpp_python, os.path.join(os.path.dirname(__file__), "llama_cpp_decode.py"), gguf_file,
                 "--new-tokens", str(args.new_tokens), "--threads", "2"]
    decode = {name: [] for name, _ in systems}
    batch = {name: [] for name, kw in systems if name.startswith("steps") and not kw["int8_activations"]}
    for r in range(args.rounds):
        for name, kwargs in systems[r % len(systems):] + systems[:r % len(systems)]:
            if kwargs is None:
                out = subprocess.run(llama_cmd, check=True, capture_output=True, text=True).stdout
                decode[name].append(json.loads(out.strip().splitlines()[-1])["rate"])
            else:
                with LLM(gguf_file, kv_cache_gib=0.0625, max_model_len=1024, **kwargs) as llm:
                    gen = pipellm_generator(llm)
                    gen(2)  # warm-up
                    decode[name].append(decode_rate(gen, args.new_tokens))
                if name in batch and not args.no_throughput:
                    batch[name].append(run_bench(gguf_file, use_tqdm=False, **kwargs)["generated_tok_s"])
            print(f"round {r}: {name} decode {decode[name][-1]:.1f} tok/s"
                  + (f", batch {batch[name][-1]:.1f}" if batch.get(name) and len(batch[name]) == r + 1 else ""),
                  flush=True)
    results = {"decode_tok_s": {k: statistics.median(v) for k, v in decode.items()},
               "batch_tok_s": {k: statistics.median(v) for k, v in batch.items() if v},
               "rounds": {"decode": decode, "batch": batch}}
    base = results["decode_tok_s"]["llama_cpp"] if args.llama_cpp_python else None
    for name, rate in results["decode_tok_s"].items():
        print(f"{name:16s} {rate:7.1f} decode tok/s" + (f"  {rate / base:.2f}x llama.cpp" if base else ""))
    for name, rate in results["batch_tok_s"].items():
        print(f"{name:16s} {rate:7.1f} generated tok/s, 32 requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results | {"args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
