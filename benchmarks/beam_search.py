"""Beam search on the default model: LLM.beam_search at P=1 and P=2 against HF transformers' generate(num_beams=...)
on the same prompts (one padded batch, fp32, 2 threads, its own process), in turns, round after round; the median
round is reported. EOS ignored, so every beam runs max_tokens steps.

    python benchmarks/beam_search.py [--width 4] [--max-tokens 32] [--rounds 3] [--json out.json]
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

from pipellm import LLM
from pipellm.sampling_params import BeamSearchParams

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "The best way to learn a language is",
           "Water boils at"]


def hf_worker(model_dir: str, width: int, max_tokens: int) -> None:
    """Its own process: HF's OpenMP threads must not share one with an engine's driver."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)

    def run(n):
        with torch.inference_mode():
            return model.generate(**batch, num_beams=width, num_return_sequences=width, max_new_tokens=n,
                                  do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    run(2)  # warm-up
    t0 = time.perf_counter()
    out = run(max_tokens)
    seconds = time.perf_counter() - t0
    best = [out[i * width, batch.input_ids.shape[1]:].tolist() for i in range(len(PROMPTS))]
    print(json.dumps({"seconds": seconds, "best": best}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.width, args.max_tokens)
    from pipellm.loader.default_model import default_model_path
    from pipellm.loader.gguf import convert_gguf

    model_dir = default_model_path()
    tmp = tempfile.TemporaryDirectory()  # ~0.5 GB of fp32 weights for HF, removed once measured
    hf_dir = os.path.join(tmp.name, "fp32")
    convert_gguf(model_dir, hf_dir)
    hf_cmd = [sys.executable, __file__, "--hf-worker", hf_dir, "--width", str(args.width),
              "--max-tokens", str(args.max_tokens)]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {"pipellm_pp1": [], "pipellm_pp2": [], "hf_generate_2_threads": []}
    best = {}
    with LLM(model_dir, pipeline_parallel_size=1, max_logprobs=2 * args.width) as pp1, \
            LLM(model_dir, pipeline_parallel_size=2, max_logprobs=2 * args.width) as pp2:
        for name, llm in (("pipellm_pp1", pp1), ("pipellm_pp2", pp2)):
            llm.beam_search(PROMPTS, BeamSearchParams(beam_width=args.width, max_tokens=2))  # warm-up
        for _ in range(args.rounds):
            for name, llm in (("pipellm_pp1", pp1), ("pipellm_pp2", pp2)):
                t0 = time.perf_counter()
                outs = llm.beam_search(PROMPTS, params)
                seconds[name].append(time.perf_counter() - t0)
                best[name] = [o.sequences[0].tokens[-args.max_tokens:] for o in outs]
            hf = json.loads(subprocess.run(hf_cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            seconds["hf_generate_2_threads"].append(hf["seconds"])
            best["hf_generate_2_threads"] = hf["best"]
    tmp.cleanup()
    tokens = len(PROMPTS) * args.width * args.max_tokens
    results = {name: statistics.median(s) for name, s in seconds.items()}
    for name, s in results.items():
        same = sum(a == b for a, b in zip(best[name], best["hf_generate_2_threads"]))
        print(f"{name:24s} {s:6.2f} s, {tokens / s:6.1f} beam tokens/s; best beam equals HF's for {same} of "
              f"{len(PROMPTS)} prompts")
    hf_s = results["hf_generate_2_threads"]
    print(f"speed vs HF: pp1 {hf_s / results['pipellm_pp1']:.2f}x, pp2 {hf_s / results['pipellm_pp2']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": results, "beam_tokens": tokens} | vars(args), f, indent=2)


if __name__ == "__main__":
    main()
