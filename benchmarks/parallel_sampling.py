"""Parallel sampling (n completions a prompt) on the default model: pipellm with the prefix cache (a request's
completions share the blocks of its prompt, written once in the batch that admits them), pipellm without it (each
completion computes the prompt), and HF transformers' generate(num_return_sequences=n) (one padded batch, fp32,
2 threads, its own process), in turns, round after round; the median round is reported. EOS ignored.

    python benchmarks/parallel_sampling.py [--n 4] [--prompts 8] [--prompt-len 192] [--max-tokens 16] [--rounds 3]
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


def prompts(count: int, length: int) -> list[list[int]]:
    return [[(37 * i + 101 * p) % 20000 + 100 for i in range(length)] for p in range(count)]


def hf_worker(model_dir: str, args) -> None:
    """Its own process: HF's OpenMP threads must not share one with an engine's driver."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(args.prompts, args.prompt_len))  # one length: no padding

    def run(n):
        with torch.inference_mode():
            model.generate(ids, num_return_sequences=args.n, max_new_tokens=n, min_new_tokens=n, do_sample=True,
                           temperature=1.0, top_k=0, pad_token_id=0)
    run(2)  # warm-up
    t0 = time.perf_counter()
    run(args.max_tokens)
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args)
    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import convert_gguf

    model_dir = default_model_path()
    tmp = tempfile.TemporaryDirectory()  # ~0.5 GB of fp32 weights for HF, removed once measured
    hf_dir = os.path.join(tmp.name, "fp32")
    convert_gguf(model_dir, hf_dir)
    hf_cmd = [sys.executable, __file__, "--hf-worker", hf_dir] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in ("n", "prompts", "prompt_len",
                                                                              "max_tokens")]
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    seconds: dict[str, list[float]] = {"pipellm_prefix_cache": [], "pipellm_no_cache": [], "hf_generate": []}
    with LLM(model_dir, enable_prefix_caching=True) as on, LLM(model_dir, enable_prefix_caching=False) as off:
        engines = {"pipellm_prefix_cache": on, "pipellm_no_cache": off}
        for llm in engines.values():
            llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for r in range(args.rounds):
            # new prompts each round: no earlier round's blocks in the cache
            batch = [{"prompt_token_ids": [t + r for t in p]} for p in prompts(args.prompts, args.prompt_len)]
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                seconds[name].append(time.perf_counter() - t0)
                assert all(len(c.token_ids) == args.max_tokens for o in outs for c in o.outputs)
            hf = json.loads(subprocess.run(hf_cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            seconds["hf_generate"].append(hf["seconds"])
    tmp.cleanup()
    results = {name: statistics.median(s) for name, s in seconds.items()}
    tokens = args.prompts * args.n * args.max_tokens
    for name, s in results.items():
        print(f"{name:22s} {s:6.2f} s, {tokens / s:6.1f} generated tok/s")
    print(f"prefix cache vs none {results['pipellm_no_cache'] / results['pipellm_prefix_cache']:.2f}x, "
          f"vs HF {results['hf_generate'] / results['pipellm_prefix_cache']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": results, "generated_tokens": tokens} | vars(args), f, indent=2)


if __name__ == "__main__":
    main()
