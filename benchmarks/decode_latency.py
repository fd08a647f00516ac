"""Single-stream decode speed of the default model: pipellm at P=1 (the stage in the driver's process, the default
there, and in a process of its own with async scheduling) and P=2 against HF transformers, in one run.

Decode tok/s = (N - 1) / (time(max_tokens=N) - time(max_tokens=1)).
    python benchmarks/decode_latency.py [--new-tokens 128] [--repeats 3] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pipellm import LLM, SamplingParams

PROMPT = "The capital of France is"


def timed(generate, n: int) -> float:
    t0 = time.perf_counter()
    generate(n)
    return time.perf_counter() - t0


def pipellm_generator(llm: LLM):
    def gen(n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == n
    return gen


def hf_generator(model_dir: str, threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def gen(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return gen


def decode_rate(gen, new_tokens: int) -> float:
    # The prompt's prefill cancels out of the difference.
    return (new_tokens - 1) / (timed(gen, new_tokens) - timed(gen, 1))


def hf_worker(model_dir: str, new_tokens: int, threads: int) -> None:
    """Runs in its own process: HF's OpenMP threads must not share a process with an engine's driver."""
    gen = hf_generator(model_dir, threads)
    gen(2)  # warm-up
    print(json.dumps({"rate": decode_rate(gen, new_tokens)}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.new_tokens, 2)
    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import convert_gguf

    model_dir = default_model_path()
    tmp = tempfile.TemporaryDirectory()  # ~0.5 GB of fp32 weights, removed once measured
    hf_dir = os.path.join(tmp.name, "fp32")
    convert_gguf(model_dir, hf_dir)  # transformers reads safetensors: the same weights as fp32
    hf_cmd = [sys.executable, __file__, "--hf-worker", hf_dir, "--new-tokens", str(args.new_tokens)]
    # The systems are measured in turns, round after round, so that the machine's drifting load hits
    # each the same; the median round is reported. Idle engines use no CPU.
    with LLM(model_dir, pipeline_parallel_size=1) as pp1, LLM(model_dir, pipeline_parallel_size=2) as pp2, \
            LLM(model_dir, pipeline_parallel_size=1, distributed_executor_backend="mp") as pp1_mp:
        engines = {"pipellm_pp1": pipellm_generator(pp1), "pipellm_pp1_mp": pipellm_generator(pp1_mp),
                   "pipellm_pp2": pipellm_generator(pp2)}
        rates = {name: [] for name in list(engines) + ["hf_generate_2_threads"]}
        for gen in engines.values():
            gen(2)  # warm-up
        for _ in range(args.repeats):
            for name, gen in engines.items():
                rates[name].append(decode_rate(gen, args.new_tokens))
            out = subprocess.run(hf_cmd, check=True, capture_output=True, text=True).stdout
            rates["hf_generate_2_threads"].append(json.loads(out.strip().splitlines()[-1])["rate"])
    tmp.cleanup()
    results = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in results.items():
        print(f"{name:24s} {rate:7.1f} decode tok/s")
    hf = results["hf_generate_2_threads"]
    print(f"ratio pp1/hf {results['pipellm_pp1'] / hf:.2f}, pp2/hf {results['pipellm_pp2'] / hf:.2f}, "
          f"pp2/pp1 {results['pipellm_pp2'] / results['pipellm_pp1']:.2f}, "
          f"pp1/pp1_mp {results['pipellm_pp1'] / results['pipellm_pp1_mp']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results | vars(args), f, indent=2)


if __name__ == "__main__":
    main()
