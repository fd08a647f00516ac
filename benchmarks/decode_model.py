"""Single-stream greedy decode speed of any model at PP=1, and what its stage holds. For A/B runs of two trees:
    git worktree add /tmp/old <rev>; PYTHONPATH=/tmp/old python benchmarks/decode_model.py gemma-3-270m
Decode tok/s = 64 / (time(65 tokens) - time(1 token)), best of --rounds."""
import argparse
import json
import time

from pipellm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--distributed-executor-backend", default=None, help="uni (the default) or mp")
    args = parser.parse_args()
    with LLM(args.model, pipeline_parallel_size=1, kv_cache_gib=0.25,
             distributed_executor_backend=args.distributed_executor_backend) as llm:
        def seconds(n: int) -> float:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate("The capital of France is", params, use_tqdm=False)
            return time.perf_counter() - start

        seconds(4)  # warm-up
        best = min(seconds(65) - seconds(1) for _ in range(args.rounds))
        print(json.dumps({"model": args.model, "backend": llm.engine.config.distributed_executor_backend,
                          "decode_tok_s": 64 / best, "stage": llm.describe_stages()[0]}))


if __name__ == "__main__":
    main()
