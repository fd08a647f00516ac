"""What a stage failure costs: SIGKILL a stage in the middle of a batch of greedy requests and measure how long the
driver takes to notice, to start a new pipeline, and to give the next token; then check the outputs against a
fault-free run of the same requests.

    python benchmarks/recovery.py [--model DIR] [-pp 2] [--stage 1] [--num-prompts 32] [--json out.json]
"""
import argparse
import json
import os
import random
import signal
import threading
import time

from pipellm import LLM, SamplingParams
from pipellm.pipeline.executor import PipelineError


def requests(num: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(64, 192))]} for _ in range(num)]


def kill_when(llm: LLM, rank: int, after_tokens: int, out: dict) -> threading.Thread:
    """SIGKILLs stage `rank` once the furthest request has after_tokens output tokens."""
    def run():
        while max([len(r.output_token_ids) for r in list(llm.engine.requests.values())] or [0]) < after_tokens:
            time.sleep(0.001)
        os.kill(llm.engine.executor.stage_status()[rank]["pid"], signal.SIGKILL)
        out["killed_at"] = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-pp", "--pipeline-parallel-size", type=int, default=2)
    ap.add_argument("--stage", type=int, default=1, help="the stage to kill")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kill-after", type=int, default=16, help="kill once a request has this many new tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    # No prefix caching: the second run would otherwise reuse the first one's prompts until the restart.
    with LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size, restart_on_failure=True,
             enable_prefix_caching=False) as llm:
        reqs = requests(args.num_prompts, llm.engine.model_config.vocab_size)
        llm.generate(reqs[:2], params, use_tqdm=False)  # warm-up
        start = time.monotonic()
        expected = [o.outputs[0].token_ids for o in llm.generate(reqs, params, use_tqdm=False)]
        fault_free_s = time.monotonic() - start
        fault: dict = {}
        kill_when(llm, args.stage, args.kill_after, fault)
        start = time.monotonic()
        outs = llm.generate(reqs, params, use_tqdm=False)
        faulty_s = time.monotonic() - start
        restart = llm.engine.restarts[-1]
        detected = restart["detected_at"]
        # The first token any request got after the failure was noticed: the pipeline is serving again.
        next_token = min(t for o in outs for t in o.metrics.token_times if t > detected)
        got = [o.outputs[0].token_ids for o in outs]

    # Without restart: how soon the user gets an error naming the stage.
    with LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size) as llm:
        fault_off: dict = {}
        kill_when(llm, args.stage, args.kill_after, fault_off)
        try:
            llm.generate(reqs, params, use_tqdm=False)
            raise SystemExit("the generation finished without noticing the killed stage")
        except PipelineError as e:
            error_s = time.monotonic() - fault_off["killed_at"]
            error = str(e).splitlines()[0]

    result = {
        "model": args.model or "default (SmolLM2-135M-Instruct)", "pipeline_parallel_size": args.pipeline_parallel_size,
        "killed_stage": args.stage, "num_prompts": args.num_prompts, "output_len": args.output_len,
        "detect_s": detected - fault["killed_at"], "restart_s": restart["start_s"],
        "kill_to_next_token_s": next_token - fault["killed_at"], "fault_free_s": fault_free_s,
        "with_fault_s": faulty_s, "outputs_identical": got == expected,
        "error_without_restart_s": error_s, "error_without_restart": error,
    }
    print(f"killed stage {args.stage} after {args.kill_after} tokens; {args.num_prompts} requests x "
          f"{args.output_len} tokens, P={args.pipeline_parallel_size}")
    print(f"  detected in {result['detect_s'] * 1000:.0f} ms; new pipeline up in {result['restart_s']:.2f} s; "
          f"kill to next token {result['kill_to_next_token_s']:.2f} s")
    print(f"  batch took {faulty_s:.2f} s vs {fault_free_s:.2f} s fault-free; outputs identical: "
          f"{result['outputs_identical']}")
    print(f"  without restart: error after {error_s * 1000:.0f} ms: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
