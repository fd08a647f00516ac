"""A soak of LoRA adapters against PEFT's model in HF transformers: per run a random tiny llama or qwen2, one to three
random PEFT adapters (random targets among the seven linear layers, rank 2-8, alpha, rsLoRA or not), prompts each
with a random adapter or none, PP=1 or 2, max_loras from 1 (adapters taking turns) to their count, and one or four
decode steps a batch; every request's greedy ids must equal HF's with its adapter.

    python benchmarks/lora_fuzz.py [--seed 1] [--runs 10]
"""
import argparse
import copy
import os
import random
import sys
import tempfile

import peft
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests.conftest

from pipellm import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.conftest import hf_greedy_ids, make_checkpoint  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def one_run(rng: random.Random, folder: str) -> bool:
    arch = rng.choice(["llama", "qwen2"])
    base = make_checkpoint(arch, f"{folder}/base", seed=rng.randrange(100))
    loras, models = [], []
    for i in range(rng.randint(1, 3)):
        torch.manual_seed(rng.randrange(1000))
        config = peft.LoraConfig(r=rng.choice([2, 4, 8]), lora_alpha=rng.choice([4, 8, 16]), init_lora_weights=False,
                                 target_modules=rng.sample(TARGETS, rng.randint(1, 7)), use_rslora=rng.random() < 0.3)
        models.append(peft.get_peft_model(copy.deepcopy(base), config).eval())
        models[-1].save_pretrained(f"{folder}/a{i}")
        loras.append(LoRARequest(f"a{i}", i + 1, f"{folder}/a{i}"))
    n = rng.randint(4, 12)
    prompts = [[rng.randrange(1, 384) for _ in range(rng.randint(2, 40))] for _ in range(rng.randint(2, 6))]
    picks = [rng.randrange(-1, len(loras)) for _ in prompts]  # -1: the base model
    want = [hf_greedy_ids(base if c < 0 else models[c], [p], n)[0] for p, c in zip(prompts, picks)]
    pp, max_loras, steps = rng.choice([1, 2]), rng.randint(1, len(loras)), rng.choice([1, 1, 4])
    one_stage_steps = pp == 1 and steps > 1  # async scheduling is the other way: off
    with LLM(f"{folder}/base", pipeline_parallel_size=pp, dtype="float32", enable_lora=True, max_loras=max_loras,
             max_lora_rank=8, num_scheduler_steps=steps, async_scheduling=False if one_stage_steps else None) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True),  # HF's
                            lora_request=[None if c < 0 else loras[c] for c in picks], use_tqdm=False)  # min_new
    got = [o.outputs[0].token_ids for o in outs]
    print(f"{'ok' if got == want else 'MISMATCH'}: {arch} pp={pp} adapters={len(loras)} max_loras={max_loras} "
          f"steps={steps} picks={picks} equal={[g == w for g, w in zip(got, want)]}", flush=True)
    return got == want


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    passed = 0
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as folder:
            passed += one_run(random.Random(args.seed * 1000 + run), folder)
    print(f"{passed} / {args.runs} runs passed")
    sys.exit(0 if passed == args.runs else 1)


if __name__ == "__main__":
    main()
