"""What structured outputs cost a decode step: the default model, 16 requests of 32 new tokens each, free against
held to a regex (EOS biased away, so both generate every token), in turns; and llguidance's mask and advance per
token for a JSON schema, alone. `python benchmarks/structured_outputs.py [--rounds 3] [-pp 1] [--json PATH]`"""
import argparse
import json
import statistics
import time

from pipellm import LLM, SamplingParams, StructuredOutputsParams
from pipellm.structured import Matcher

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 10}}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-pp", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ask = [{"role": "user", "content": f"Describe city number {i} (name, country, population) as JSON."}
           for i in range(16)]
    with LLM(pipeline_parallel_size=args.pp) as llm:
        eos = {t: -100.0 for t in llm.engine.eos_token_ids}
        prompts = [llm.chat_prompt([m]) for m in ask]
        runs = {"free": SamplingParams(max_tokens=32, temperature=0.0, logit_bias=eos),
                "regex": SamplingParams(max_tokens=32, temperature=0.0, logit_bias=eos,
                                        structured_outputs=StructuredOutputsParams(regex=r"[A-Za-z]+( [A-Za-z]+)*"))}
        llm.generate(prompts[:2], list(runs.values())[:1] * 2, use_tqdm=False)  # warm-up, tokenizer tables built
        llm.generate(prompts[:1], runs["regex"], use_tqdm=False)
        tok_s = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, params in runs.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                tok_s[name].append(n / (time.perf_counter() - start))
        # llguidance alone: the mask and the advance for each token of a JSON answer
        spec = StructuredOutputsParams(json=SCHEMA)
        answer = llm.generate(prompts[0], SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=spec),
                              use_tqdm=False)[0].outputs[0].token_ids
        tokenizer, vocab = llm.engine.inputs.structured_tokenizer, llm.engine.model_config.vocab_size
        per_token = []
        for _ in range(20):
            m = Matcher(tokenizer, spec)
            for t in answer:
                start = time.perf_counter()
                m.allowed(vocab)
                m.consume(t)
                per_token.append(time.perf_counter() - start)
    result = {"pp": args.pp, "rounds": args.rounds, "generated_tok_s": tok_s,
              "regex_over_free": statistics.median(tok_s["regex"]) / statistics.median(tok_s["free"]),
              "json_mask_and_advance_us_median": statistics.median(per_token) * 1e6,
              "json_answer_tokens": len(answer)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
