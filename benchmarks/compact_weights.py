"""Compact (GGUF-format) weights against the same weights widened to fp32, on the default model, in one run.

    python benchmarks/compact_weights.py [--rounds 3] [--json out.json] [--llama-cpp-python PYTHON]
Single-stream decode (as decode_latency.py: 127 / (t(128) - t(1))) for compact PP=1 (fp32 and 8-bit activations) and
PP=2, fp32 PP=1, HF transformers fp32 (own process) and, given a Python with llama-cpp-python, llama.cpp on the same
file and threads (llama_cpp_decode.py, own process); the throughput workload (32 requests, 64-192 prompt tokens,
64 new) compact vs fp32; and each stage's memory. Systems run in turns, round after round; medians are reported.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from decode_latency import decode_rate, pipellm_generator

from pipellm import LLM
from pipellm.entrypoints.bench import run_bench
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import convert_gguf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-cpp-python", default=None, help="a Python interpreter that has llama_cpp")
    args = parser.parse_args()
    gguf_file = default_model_path()
    tmp = tempfile.TemporaryDirectory()  # ~0.5 GB of fp32 weights, removed when main() returns
    fp32_dir = os.path.join(tmp.name, "fp32")
    convert_gguf(gguf_file, fp32_dir)  # the same weights, dequantized: what pipellm held before compact weights
    hf_cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "decode_latency.py"), "--hf-worker", fp32_dir,
              "--new-tokens", str(args.new_tokens)]
    llama_cmd = None if args.llama_cpp_python is None else [
        args.llama_cpp_python, os.path.join(os.path.dirname(__file__), "llama_cpp_decode.py"), gguf_file,
        "--new-tokens", str(args.new_tokens), "--threads", "2"]
    results, memory = {}, {}
    rates = {k: [] for k in ("decode_compact_pp1", "decode_compact_int8_pp1", "decode_compact_pp2",
                             "decode_fp32_pp1", "decode_hf_fp32") + (("decode_llama_cpp",) if llama_cmd else ())}
    small = dict(kv_cache_gib=0.0625, max_model_len=1024)
    with LLM(gguf_file, pipeline_parallel_size=1, **small) as c1, \
            LLM(gguf_file, pipeline_parallel_size=1, int8_activations=True, **small) as c1_int8, \
            LLM(gguf_file, pipeline_parallel_size=2, **small) as c2, \
            LLM(fp32_dir, pipeline_parallel_size=1, dtype="float32", **small) as f1:
        engines = {"decode_compact_pp1": c1, "decode_compact_int8_pp1": c1_int8, "decode_compact_pp2": c2,
                   "decode_fp32_pp1": f1}
        for name, llm in engines.items():
            memory[name.removeprefix("decode_")] = [dict(weights=r.weight_bytes, rss=r.rss_bytes, kv=r.kv_cache_bytes)
                                                    for r in llm.engine.inspect()]
            pipellm_generator(llm)(2)  # warm-up
        for _ in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(decode_rate(pipellm_generator(llm), args.new_tokens))
            for name, cmd in (("decode_hf_fp32", hf_cmd), ("decode_llama_cpp", llama_cmd)):
                if cmd:
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                    rates[name].append(json.loads(out.strip().splitlines()[-1])["rate"])
    workload = dict(num_prompts=32, input_len=(64, 192), output_len=64, use_tqdm=False)
    systems = {"batch_compact_pp1": dict(model=gguf_file, pipeline_parallel_size=1),
               "batch_fp32_pp1": dict(model=fp32_dir, pipeline_parallel_size=1, dtype="float32"),
               "batch_compact_pp2": dict(model=gguf_file, pipeline_parallel_size=2),
               "batch_fp32_pp2": dict(model=fp32_dir, pipeline_parallel_size=2, dtype="float32"),
               # dtype="auto": bf16 where this CPU's bf16 matmul is faster (the same as fp32 elsewhere)
               "batch_dense_auto_pp1": dict(model=fp32_dir, pipeline_parallel_size=1)}
    rates.update({name: [] for name in systems})
    for _ in range(max(1, args.rounds - 1)):
        for name, kwargs in systems.items():
            rates[name].append(run_bench(**workload, **kwargs)["generated_tok_s"])
    results = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in results.items():
        print(f"{name:20s} {rate:7.1f} tok/s")
    print(f"decode: compact/fp32 {results['decode_compact_pp1'] / results['decode_fp32_pp1']:.2f}, "
          f"compact/hf {results['decode_compact_pp1'] / results['decode_hf_fp32']:.2f}, "
          f"int8 activations/fp32 ones {results['decode_compact_int8_pp1'] / results['decode_compact_pp1']:.2f}; "
          f"batch: compact/fp32 pp1 {results['batch_compact_pp1'] / results['batch_fp32_pp1']:.2f}, "
          f"pp2 {results['batch_compact_pp2'] / results['batch_fp32_pp2']:.2f}, compact/dense (dtype auto) pp1 "
          f"{results['batch_compact_pp1'] / results['batch_dense_auto_pp1']:.2f}")
    if "decode_llama_cpp" in results:
        print(f"decode vs llama.cpp: compact {results['decode_compact_pp1'] / results['decode_llama_cpp']:.2f}, "
              f"with 8-bit activations {results['decode_compact_int8_pp1'] / results['decode_llama_cpp']:.2f}")
    for name, stages in memory.items():
        print(name, "; ".join(f"stage {i}: {sum(n for _, n in s['weights']) / 1e6:.0f} MB weights, "
                              f"{s['rss'] / 1e6:.0f} MB resident" for i, s in enumerate(stages)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rates=results, memory=memory, file_bytes=os.path.getsize(gguf_file)), f, indent=2)


if __name__ == "__main__":
    main()
