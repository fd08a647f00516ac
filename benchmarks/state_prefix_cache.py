"""Prefix caching for a model whose layers keep a state per sequence: a Qwen3.5-shaped model (random weights; three
gated delta nets to each full-attention layer), served requests one after another, with the prefix cache on and off
in the same run, and HF transformers' `generate` on the same prompts as a peer (it keeps nothing between calls):
- shared: a system prompt of --system tokens, then --questions requests, each the system prompt and a question of
  32 tokens (the first two part after the system prompt: the second saves its state there, the rest start there);
- conversation: --turns turns, each prompt the whole conversation so far and 32 more tokens, 32 new tokens a turn;
- completions: --n greedy completions of one new prompt as long as the first workload's (one request; HF: the
  prompt --n times in one batch, as its num_return_sequences expands it).
Greedy ids must be the same both ways (and HF's); prints seconds and time to first token per workload.

    python benchmarks/state_prefix_cache.py [--system 512] [--questions 6] [--turns 4] [--n 4] [--pp 1]
        [--json out.json]
"""
import argparse
import json
import tempfile
import time

import torch
import transformers as tf

from pipellm import LLM, SamplingParams

NEW_TOKENS = 32


def workloads(system: int, questions: int, turns: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()
    head = tokens(system)
    return {"shared": [head + tokens(32) for _ in range(questions)], "conversation": [tokens(32) for _ in range(turns)],
            "completions": tokens(system + 32)}


def run(requests: list[list[int]], conversation: bool, generate) -> tuple[float, list[float], list[list[int]]]:
    """Requests one after another; a conversation's prompt is everything before it plus its next 32 tokens. Returns
    the total seconds, each request's seconds to its first token, and the new ids."""
    history, first, outputs = [], [], []
    start = time.perf_counter()
    for req in requests:
        prompt = history + req if conversation else req
        ids, ttft = generate(prompt)
        first.append(ttft)
        outputs.append(ids)
        history = prompt + ids
    return time.perf_counter() - start, first, outputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = tf.Qwen3_5TextConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = tf.Qwen3_5ForCausalLM(cfg).eval()
    work = workloads(args.system, args.questions, args.turns, cfg.vocab_size)
    results, ids = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        for cached in (True, False):
            with LLM(folder, dtype="float32", pipeline_parallel_size=args.pp, enable_prefix_caching=cached,
                     max_model_len=4096) as llm:
                params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

                def generate(prompt):
                    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
                    return list(out.outputs[0].token_ids), out.metrics.first_token_time - out.metrics.arrival_time
                llm.generate([{"prompt_token_ids": [5] * 40}], params, use_tqdm=False)  # warm-up
                for name, reqs in work.items():
                    hits, start = llm.engine.block_manager.num_prefix_hits, time.perf_counter()
                    if name == "completions":
                        out = llm.generate([{"prompt_token_ids": reqs}], SamplingParams(
                            n=args.n, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
                        total, ttft, ids[name, cached] = time.perf_counter() - start, None, [
                            list(c.token_ids) for c in out.outputs]
                    else:
                        total, ttft, ids[name, cached] = run(reqs, name == "conversation", generate)
                    results[f"{name}, prefix cache {'on' if cached else 'off'}"] = dict(
                        seconds=total, ttft=ttft, cached_tokens=llm.engine.block_manager.num_prefix_hits - hits)

    def hf_generate(prompt):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
        return out[0, len(prompt):].tolist(), None
    for name, reqs in work.items():
        if name == "completions":
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(torch.tensor([reqs] * args.n), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
            total, ids[name, "hf"] = time.perf_counter() - start, out[:, len(reqs):].tolist()
        else:
            total, _, ids[name, "hf"] = run(reqs, name == "conversation", hf_generate)
        results[f"{name}, HF generate"] = dict(seconds=total)
    for name in work:
        same = ids[name, True] == ids[name, False]
        print(f"{name}: greedy ids equal with the cache on and off: {same}; equal to HF's: "
              f"{ids[name, True] == ids[name, 'hf']}")
        assert same
    for key, r in results.items():
        ttft = f", time to first token {sum(r['ttft']) / len(r['ttft']):.3f} s on average " \
               f"({', '.join(f'{t:.2f}' for t in r['ttft'])})" if r.get("ttft") else ""
        ttft += f", {r['cached_tokens']} prompt tokens cached" if "cached_tokens" in r else ""
        print(f"{key}: {r['seconds']:.2f} s{ttft}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
