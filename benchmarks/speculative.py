"""N-gram speculative decoding against plain decoding, on the default model, in alternating rounds of the same run:
generated tok/s of one chat request at a time (the latency case speculation is for; greedy, or seeded draws), where
the answer copies the prompt (a text to repeat, code to edit) and where it does not (free writing), and the drafts
kept.
`python benchmarks/speculative.py [--model PATH] [--dtype auto] [-pp 1] [--threads 2] [--rounds 3] [--tokens 4]
[--lookup 3-4] [--temperature 0] [--json FILE]`"""
import argparse
import json
import statistics
import time

from pipellm import LLM, SamplingParams

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
        "agreed to increase funding for children's books, to extend opening hours on weekends, and to hire two more "
        "librarians. The chair thanked everyone for their work and closed the meeting at nine o'clock.")
CODE = ("def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total += item.price * "
        "item.quantity\n    return total * (1 + tax_rate)\n")
TASKS = {
    "copy": [f"Repeat the following text exactly, word for word:\n\n{TEXT}",
             f"Rewrite this function with the parameter tax_rate renamed to rate. Give only the code.\n\n{CODE}"],
    "free": ["Write a short story about a lighthouse keeper.", "Explain how rain forms, in a few sentences."],
}


def run(llm: LLM, prompts: list[str], max_tokens: int, temperature: float = 0.0) -> tuple[float, int]:
    """Generated tokens per second over the prompts one after another, and the tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(llm.chat([[{"role": "user", "content": p}]], params, use_tqdm=False)[0].outputs[0].token_ids)
    return tokens / (time.perf_counter() - start), tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-pp", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="per stage (default: cores // stages)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded draws")
    parser.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup", default="3-4", help="prompt_lookup_min-prompt_lookup_max")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    low, high = map(int, args.lookup.split("-"))
    spec_config = {"method": "ngram", "num_speculative_tokens": args.tokens, "prompt_lookup_min": low,
                   "prompt_lookup_max": high}
    figures = {kind: {"plain": [], "ngram": []} for kind in TASKS}
    accepted = {}
    engine = dict(pipeline_parallel_size=args.pp, threads_per_stage=args.threads, dtype=args.dtype)
    with LLM(args.model, **engine) as plain, LLM(args.model, speculative_config=spec_config, **engine) as spec:
        for llm in (plain, spec):
            run(llm, TASKS["copy"][:1], 16)  # warm-up
        for r in range(args.rounds):
            for kind, prompts in TASKS.items():
                for name, llm in (("plain", plain), ("ngram", spec))[::1 if r % 2 == 0 else -1]:
                    e = llm.engine
                    drafts, kept = e.num_draft_tokens, e.num_accepted_tokens
                    rate, tokens = run(llm, prompts, args.max_tokens, args.temperature)
                    figures[kind][name].append(rate)
                    if name == "ngram":
                        accepted.setdefault(kind, []).append((e.num_accepted_tokens - kept, e.num_draft_tokens - drafts,
                                                              tokens))
                    print(f"round {r} {kind} {name}: {rate:.1f} tok/s", flush=True)
    summary = {}
    for kind in TASKS:
        p, s = (statistics.median(figures[kind][k]) for k in ("plain", "ngram"))
        kept, drafts, tokens = (sum(x[i] for x in accepted[kind]) for i in range(3))
        summary[kind] = dict(plain_tok_s=p, ngram_tok_s=s, ratio=s / p, drafts_kept=kept, drafts_run=drafts,
                             tokens=tokens, rounds=figures[kind])
        print(f"{kind}: plain {p:.1f} tok/s, ngram {s:.1f} ({s / p:.2f}x); drafts kept {kept}/{drafts}, "
              f"{tokens} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args) | {"speculative_config": spec_config}, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
