"""Single-stream greedy decode of an LFM2-350M-shaped model (random weights: hidden 1024, 16 layers, 10 of them gated
short convolutions, 6 attention; vocabulary 65,536) in pipellm, fp32 and int8, against HF transformers on the same
weights, and against a Llama of the same width and depth whose layers run the one-call decode step (LFM2's layers
with a state run layer by layer), in one run.
Decode tok/s = (N - 1) / (time(N tokens) - time(1 token)), after a warm-up; the median of --rounds.

    python benchmarks/lfm2_decode.py [--new-tokens 64] [--rounds 3] [--json out.json]
"""
import argparse
import json
import statistics
import tempfile
import time

import torch
import transformers as tf

from pipellm import LLM, SamplingParams

PROMPT = list(range(5, 45))  # 40 tokens
SHAPE = dict(vocab_size=65536, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             max_position_embeddings=4096, tie_word_embeddings=True)


def rate(generate, n: int, rounds: int) -> float:
    generate(2)

    def seconds(k):
        start = time.perf_counter()
        generate(k)
        return time.perf_counter() - start
    return statistics.median((n - 1) / (seconds(n) - seconds(1)) for _ in range(rounds))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    models = {"lfm2": tf.Lfm2ForCausalLM(tf.Lfm2Config(**SHAPE, intermediate_size=6656,
                                                        full_attn_idxs=[2, 5, 8, 10, 12, 14])).eval(),
              "llama": tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, intermediate_size=4608, head_dim=64)).eval()}
    results = {}
    for name, model in models.items():
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)

            def hf(n):
                with torch.no_grad():
                    model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)
            if name == "lfm2":
                results["lfm2, HF transformers fp32"] = rate(hf, args.new_tokens, args.rounds)
            for quantization in (None, "int8"):
                with LLM(folder, dtype="float32", quantization=quantization) as llm:
                    def ours(n):
                        llm.generate([{"prompt_token_ids": PROMPT}],
                                     SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
                    results[f"{name}, pipellm {quantization or 'fp32'}"] = rate(ours, args.new_tokens, args.rounds)
    for key, tps in results.items():
        print(f"{key}: {tps:.1f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), tok_per_s=results), f, indent=1)


if __name__ == "__main__":
    main()
