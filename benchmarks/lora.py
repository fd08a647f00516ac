"""What a LoRA adapter costs: a Llama of the default model's shape (SmolLM2-135M: 30 layers of width 576; random
weights, fp32) with random rank-16 PEFT adapters on all seven linear layers of every decoder layer, in pipellm
(without enable_lora; with it but no adapter; every request with one adapter; half with each of two) and in HF
transformers with PEFT's model (unmerged, as it serves several), in one run.
Single stream: decode tok/s = (N - 1) / (time(N tokens) - time(1 token)). Batch: --batch requests of 64-token
prompts (cached after the warm-up), output tokens / wall time. The cases take turns each round; medians of --rounds.

    python benchmarks/lora.py [--new-tokens 64] [--batch 8] [--rounds 5] [--json out.json]
"""
import argparse
import contextlib
import copy
import json
import statistics
import tempfile
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from pipellm import LLM, LoRARequest, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = list(range(1000, 1064))
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           rope_theta=100000.0, tie_word_embeddings=True)


def seconds(generate, n: int) -> float:
    start = time.perf_counter()
    generate(n)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    base = LlamaForCausalLM(SMOLLM2_135M).eval()
    n, prompts = args.new_tokens, [{"prompt_token_ids": [t + i for t in PROMPT]} for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = f"{tmp}/base"
        base.save_pretrained(folder)
        peft_models = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            model = get_peft_model(copy.deepcopy(base), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                                                    init_lora_weights=False))
            model.save_pretrained(f"{tmp}/a{seed}")
            peft_models.append(model.eval())
        loras = [LoRARequest("a1", 1, f"{tmp}/a1"), LoRARequest("a2", 2, f"{tmp}/a2")]

        def hf(model):
            def run(k):
                with torch.no_grad():
                    model.generate(torch.tensor([PROMPT]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                   pad_token_id=0)
            return run

        def ours(llm, use, batch):
            def run(k):
                llm.generate(prompts[:batch], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True),
                             lora_request=[use[i % len(use)] for i in range(batch)], use_tqdm=False)
            return run
        plain = stack.enter_context(LLM(folder, dtype="float32"))
        with_lora = stack.enter_context(LLM(folder, dtype="float32", enable_lora=True, max_loras=2))
        single = {"HF transformers": hf(base), "HF transformers + PEFT adapter": hf(peft_models[0]),
                  "pipellm": ours(plain, [None], 1), "pipellm enable_lora, no adapter": ours(with_lora, [None], 1),
                  "pipellm, one adapter": ours(with_lora, loras[:1], 1)}
        batch = {"pipellm": ours(plain, [None], args.batch),
                 "pipellm enable_lora, no adapter": ours(with_lora, [None], args.batch),
                 "pipellm, one adapter": ours(with_lora, loras[:1], args.batch),
                 "pipellm, two adapters (half each)": ours(with_lora, loras, args.batch)}
        for run in [*single.values(), *batch.values()]:
            run(2)  # warm-up; the prompts stay cached: the rounds time decoding
        rates: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # the cases in turn each round: the machine's drift spreads over all of them
            for name, run in single.items():
                rates.setdefault(f"single stream, {name}", []).append((n - 1) / (seconds(run, n) - seconds(run, 1)))
            for name, run in batch.items():
                rates.setdefault(f"batch of {args.batch}, {name}", []).append(n * args.batch / seconds(run, n))
    results = {key: statistics.median(r) for key, r in rates.items()}
    for key, tps in results.items():
        print(f"{key}: {tps:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), tok_per_s=results, rounds=rates), f, indent=1)


if __name__ == "__main__":
    main()
