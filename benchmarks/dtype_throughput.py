"""float32 against bfloat16 activations on an HF checkpoint (the default model's weights, dequantized from its GGUF
to an fp32 folder once), the throughput workload, PP=1 with 2 threads and PP=2 with 1 thread a stage, in turns.
dtype="auto" picks bf16 where this CPU's bf16 matmul is faster (AVX512-BF16 / AMX); this shows what that gains.

    python benchmarks/dtype_throughput.py [--rounds 2] [--folder /tmp/pipellm-default-fp32]
"""
import argparse
import os

from pipellm.entrypoints.bench import run_bench
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import convert_gguf


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--folder", default="/tmp/pipellm-default-fp32", help="the fp32 folder, made if missing")
    args = parser.parse_args()
    if not os.path.isdir(args.folder):
        convert_gguf(default_model_path(), args.folder, weights=True)
    for _ in range(args.rounds):
        for dtype in ("float32", "bfloat16"):
            for pp, threads in ((1, 2), (2, 1)):
                r = run_bench(args.folder, pipeline_parallel_size=pp, threads_per_stage=threads, dtype=dtype,
                              use_tqdm=False, layer_partition="auto" if pp == 2 else None)
                print(f"{dtype:9s} PP={pp} x {threads} thread(s): {r['generated_tok_s']:6.1f} generated tok/s, "
                      f"bubble {r['bubble_pct']:.1f}%", flush=True)


if __name__ == "__main__":
    main()
