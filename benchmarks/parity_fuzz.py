"""A soak of correctness: random engine configurations (stages, partitions, block sizes, token budgets, batch sizes,
prefix caching, multi-step decoding, n-gram speculation, the stage in the driver's process or not, async
scheduling, batches in flight, a KV cache small enough to preempt, priority scheduling with a priority a request) over the tested families' tiny random
checkpoints, each run checked two ways:
- greedy: the ids equal HF transformers' `generate` (EOS ignored on both sides: HF's min_new_tokens would mask it,
  while vLLM's and pipellm's ignore_eos let it be drawn as any other token), but where HF's two tokens are within
  1e-5 of a tie (without a penalty; the run says so), in one run of three under a repetition penalty; in three runs of five with the top-k log-probabilities of each new and prompt token, which must be HF's
  log-softmax of the same (raw) rows (or, where fp32 rounding moves both, no farther from the same model's fp64
  ones than HF's fp32 ones are, within the tolerance; the run says so);
- seeded sampling (temperature, top-p, top-k, a seed a request, n of 1 or 2 completions): the tokens equal those of
  the same requests under the defaults at one stage, but where a draw is within 1e-5 of a tie on HF's logits (its
  uniform by a boundary between the two tokens, or a token at the top-k or top-p cut), which the last bits of the
  logits decide.
In one run of four, a beam search over one or two of the prompts (EOS ignored) equals HF's `generate(num_beams=...)`,
and each beam's cumulative log-probability HF's (1e-4; for the families whose fp32 rounding moves them further, the
tests' tolerance for them). The families with linear-attention layers run without speculation, which they refuse.
In three runs of ten the greedy requests run once more through the server's engine loop (AsyncEngine), arriving
at staggered times, some closed by their client after a few tokens: the tokens streamed equal the offline ones (or
begin them), the texts too, and no KV block is held once every stream has ended and the engine thread has drained
the pipeline.
Prints a line a run (with the preemptions the small caches caused) and the failing runs' seeds; exits 1 if any
failed. Each run draws from its own seed, so `--seed S --runs 1` replays run S.

    python benchmarks/parity_fuzz.py [--seed 0] [--runs 40] [--family gpt_oss]
"""
import argparse
import asyncio
import copy
import os
import random
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests.*

from pipellm import LLM, SamplingParams  # noqa: E402
from pipellm.engine.async_engine import AsyncEngine  # noqa: E402
from pipellm.model_config import ModelConfig  # noqa: E402
from pipellm.engine.engine import _SEED_STRIDE  # noqa: E402  (completion i of a request draws from seed + i * it)
from pipellm.sampling_params import BeamSearchParams  # noqa: E402
from tests.conftest import ARCHS, NUM_LAYERS, make_checkpoint  # noqa: E402
from tests.test_families import FAMILIES, TOLERANCE, make_family_checkpoint  # noqa: E402


def checkpoint(name: str, folder: str):
    return make_checkpoint(name, folder) if name in ARCHS else make_family_checkpoint(name, folder)


def engine_options(rng: random.Random) -> dict:
    pp = rng.choice([1, 2, 2, 3])
    kw = dict(pipeline_parallel_size=pp, dtype="float32", block_size=rng.choice([2, 4, 8, 16]),
              max_num_batched_tokens=rng.choice([8, 16, 32, 64, 256]), max_num_seqs=rng.choice([2, 4, 8, 16]),
              enable_prefix_caching=rng.random() < 0.7)
    several = rng.random()  # one way (at most) of running several tokens a request a step
    if several < 0.25:
        kw["num_scheduler_steps"] = rng.choice([2, 4])
    elif several < 0.5:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3, 6]),
                                    "prompt_lookup_min": rng.choice([1, 2]), "prompt_lookup_max": rng.choice([2, 4])}
    if pp == 1:  # the stage in the driver's process, or one of its own, with the next batch sent early or not
        kw["distributed_executor_backend"] = rng.choice(["uni", "mp", "mp"])
        if kw["distributed_executor_backend"] == "mp" and several >= 0.25 and "speculative_config" not in kw:
            kw["async_scheduling"] = rng.choice([None, False])
    elif rng.random() < 0.3:
        kw["max_batches_in_flight"] = rng.choice([1, pp + 1])
    if pp > 1 and rng.random() < 0.5:
        cuts = sorted(rng.sample(range(1, NUM_LAYERS), pp - 1))
        kw["layer_partition"] = [b - a for a, b in zip([0, *cuts], [*cuts, NUM_LAYERS])]
    if rng.random() < 0.2:
        # a few blocks a layer, shared by up to 16 requests: they are preempted and come back
        kw |= dict(kv_cache_gib=rng.choice([0.0001, 0.0002]), max_num_seqs=16)
    return kw


def draw_margin(hf, prompt: list[int], tokens: list[int], other: list[int], params: SamplingParams,
                index: int) -> float:
    """Where two seeded samplings of one request first part, on HF's logits filtered as HF filters them: how near a
    tie the draw was. The nearest of: the request's uniform to the boundary between the two tokens drawn (a share of
    the kept mass); the top-k cut's weights; the top-p cut's mass and weights. A few 1e-7 is a near-tie that the last
    bits of two batches' logits decide; a real fault is far from one."""
    j = next(i for i, (a, b) in enumerate(zip(tokens, other)) if a != b)
    with torch.no_grad():
        w = hf(torch.tensor([prompt + tokens[:j]])).logits[0, -1].double() / params.temperature
    w = (w - w.max()).exp()
    margins = []
    if 0 < params.top_k < len(w):
        kth, next_one = w.topk(params.top_k + 1).values[-2:]
        margins.append((kth - next_one).item() / kth.item())
        w[w < kth] = 0
    if params.top_p < 1:
        ascending = w.sort()
        mass = ascending.values.cumsum(0) / w.sum()
        drop = mass <= 1 - params.top_p
        last = int(drop.sum())  # the first kept, after the last dropped
        margins.append(abs(mass[last] - (1 - params.top_p)).item())
        if last:
            margins.append(abs(mass[last - 1] - (1 - params.top_p)).item())
            margins.append((ascending.values[last] - ascending.values[last - 1]).item() / ascending.values[last].item())
        w[ascending.indices[drop]] = 0
    cdf = w.cumsum(0)
    gen = torch.Generator().manual_seed((params.seed + index * _SEED_STRIDE) % 2 ** 63)  # completion index's
    u = [torch.rand(1, generator=gen, dtype=torch.float64).item() for _ in range(j + 1)][-1]
    lo, hi = sorted((tokens[j], other[j]))  # the boundary between them: lo's interval's end, hi's start
    margins.append(max(abs(u * cdf[-1] - cdf[lo]), cdf[hi - 1] - cdf[lo]).item() / cdf[-1].item())
    return min(margins)


def fp64_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """The log-softmax rows [len - 1, V] the model gives in fp64 over tokens (each row scores the next token)."""
    model = copy.deepcopy(hf).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0], -1)


def stream(engine, inputs: list[dict], params: list[SamplingParams], delays: list[float],
           cut_after: list[int | None]) -> list[tuple[list[int], str]]:
    """The requests through the server's engine loop (AsyncEngine), arriving after their delays (s): each one's
    streamed tokens and text, a request closed by its client after cut_after[i] tokens where that is set."""
    async def one(i: int, engine_loop: AsyncEngine):
        await asyncio.sleep(delays[i])
        tokens, text = [], ""
        deltas = engine_loop.generate(f"stream-{i}", inputs[i]["prompt_token_ids"], params[i])
        async for batch in deltas:
            for d in batch:
                tokens, text = tokens + d.token_ids, text + d.text
            if cut_after[i] is not None and len(tokens) >= cut_after[i]:
                await deltas.aclose()  # as a client that hangs up: the request is aborted
                break
        return tokens, text

    async def main():
        engine_loop = AsyncEngine(engine)
        engine_loop.start()
        try:
            out = await asyncio.wait_for(asyncio.gather(*(one(i, engine_loop) for i in range(len(inputs)))), 300)
            for _ in range(3000):  # the engine thread's own work: the hung-up requests' batches out drained
                if not (engine.in_flight or engine.has_unfinished_requests()):
                    break
                await asyncio.sleep(0.01)
            return out
        finally:
            engine_loop.stop()
    return asyncio.run(main())


def one_run(seed: int, models: dict, tmp: str, family: str | None = None) -> tuple[bool, str]:
    rng = random.Random(seed)
    name = rng.choice([*FAMILIES, *ARCHS])
    name = family or name  # drawn all the same: the rest of the run is as without --family
    folder = os.path.join(tmp, name)
    if name not in models:
        models[name] = checkpoint(name, folder)
    hf = models[name]
    kw = engine_options(rng)
    tol = TOLERANCE.get(name, 1e-4)
    if ModelConfig.from_pretrained(folder).keeps_states:
        kw.pop("speculative_config", None)  # a state a sequence cannot step back from a rejected draft
    shared = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]  # a prefix some prompts share
    prompts = [shared[:rng.randrange(len(shared) + 1)] + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
               for _ in range(rng.randrange(1, 9))]
    lengths = [rng.randrange(1, 20) for _ in prompts]  # requests that finish at different steps
    k = rng.choice([None, None, 0, 1, 5])  # log-probabilities of the greedy tokens, and of the prompts
    penalty = rng.choice([1.0, 1.0, 1.3])  # HF's repetition penalty (vLLM's): over the prompt and output
    sampled = [SamplingParams(max_tokens=n, temperature=rng.choice([0.5, 0.8, 1.2]), top_p=rng.choice([1.0, 0.9]),
                              top_k=rng.choice([0, 20]), seed=rng.randrange(1 << 30), ignore_eos=True,
                              n=rng.choice([1, 1, 2])) for n in lengths]
    order_rng = random.Random(f"priority {seed}")  # its own draws: the other checks of a seed stay as they were
    priority = None
    if order_rng.random() < 0.3:
        kw["scheduling_policy"] = "priority"
        priority = [order_rng.randrange(-2, 3) for _ in prompts]
    with LLM(folder, **kw) as llm:
        # within the context a small cache leaves (the engine lowers max_model_len to it)
        longest = min(hf.config.get_text_config().max_position_embeddings, llm.engine.max_model_len) - max(lengths)
        inputs = [{"prompt_token_ids": p[:longest]} for p in prompts]
        greedy = llm.generate(inputs, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=k,
                                                      prompt_logprobs=k, repetition_penalty=penalty)
                                       for n in lengths], use_tqdm=False, priority=priority)
        drawn = llm.generate(inputs, sampled, use_tqdm=False, priority=priority)
        beam_rng = random.Random(f"beams {seed}")  # its own draws: the other checks of a seed stay as they were
        beam = None
        if beam_rng.random() < 0.25:
            beam = BeamSearchParams(beam_width=beam_rng.choice([2, 3]), max_tokens=beam_rng.randrange(1, 7),
                                    ignore_eos=True)
            beam_inputs = inputs[:beam_rng.choice([1, 2])]
            beams = llm.beam_search(beam_inputs, beam)
        streamed = None
        if rng.random() < 0.3:  # the greedy requests again, as a server runs them, some hung up on
            plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repetition_penalty=penalty)
                     for n in lengths]
            cut_after = [rng.choice([None, None, 1, 3]) for _ in inputs]
            streamed = stream(llm.engine, inputs, plain, [rng.choice([0, 0, 0.01, 0.05]) for _ in inputs], cut_after)
            bm = llm.engine.block_manager
            leaked = bm.num_blocks - bm.num_free_blocks
        preemptions = llm.engine.scheduler.num_preemptions
        cached = llm.engine.block_manager.num_prefix_hits
    about = (f"{name} {kw} prompts of {[len(i['prompt_token_ids']) for i in inputs]} tokens"
             f"{'' if priority is None else f', priorities {priority}'}"
             f"{'' if k is None else f', logprobs={k}'}{'' if penalty == 1 else f', repetition_penalty={penalty}'}"
             f", {preemptions} preemptions, {cached} prompt tokens cached{'' if streamed is None else ', streamed'}"
             f"{'' if beam is None else f', beam search of width {beam.beam_width}'}")
    expected, hf_logprobs = [], []  # HF's greedy ids, and log-softmax rows [prompt - 1 + new, V] of what they saw
    with torch.no_grad():
        for i, n in zip(inputs, lengths):
            ids = torch.tensor([i["prompt_token_ids"]])
            out = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                              repetition_penalty=penalty, output_logits=True, return_dict_in_generate=True)
            expected.append(out.sequences[0, ids.shape[1]:].tolist())
            rows = torch.cat([hf(ids).logits[0, :-1], torch.cat(out.logits)]).float()
            hf_logprobs.append(torch.log_softmax(rows, dim=-1))
    with LLM(folder, dtype="float32") as llm:
        reference = llm.generate(inputs, sampled, use_tqdm=False)
    if beam is not None:
        for i, out in zip(beam_inputs, beams):
            prompt = i["prompt_token_ids"]
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), num_beams=beam.beam_width, do_sample=False,
                                   num_return_sequences=beam.beam_width, max_new_tokens=beam.max_tokens,
                                   eos_token_id=None, pad_token_id=0).tolist()
                # each token scored after the tokens before it alone, as a step runs (with longrope, a forward
                # pass over the whole beam would turn its earlier keys by the long factors)
                hf_cum = [sum(torch.log_softmax(hf(torch.tensor([w[:t]])).logits[0, -1].float(), -1)[w[t]].item()
                              for t in range(len(prompt), len(w))) for w in want]
            if [s.tokens for s in out.sequences] != want:
                return False, f"{about}: beams {[s.tokens[len(prompt):] for s in out.sequences]} are not HF's " \
                              f"{[w[len(prompt):] for w in want]}"
            worst = max(abs(s.cum_logprob - c) for s, c in zip(out.sequences, hf_cum))
            if worst > tol:
                return False, f"{about}: beams' cum_logprob off HF's by up to {worst:.2e}"
    tied = {}  # request -> the step where its pick and HF's, within 1e-5 of a tie on HF's logits, went apart
    for r, (o, want, lp, i) in enumerate(zip(greedy, expected, hf_logprobs, inputs)):
        got = o.outputs[0].token_ids
        if got == want:
            continue
        t = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        # which of two tokens this close wins, the last bits of the logits decide (HF's raw logits: no penalty)
        margin = None if t is None or penalty != 1 else \
            (lp[len(i["prompt_token_ids"]) - 1 + t, want[t]] - lp[len(i["prompt_token_ids"]) - 1 + t, got[t]]).item()
        if margin is None or margin > 1e-5:
            return False, f"{about}: greedy ids differ from HF's"
        tied[r] = t
        about += f"; a greedy pick within {margin:.1e} of a tie went the other way"
    if streamed is not None:
        for o, (tokens, text), cut in zip(greedy, streamed, cut_after):
            want = o.outputs[0].token_ids
            if tokens != (want if cut is None else want[:len(tokens)]) or cut is not None and len(tokens) < min(
                    cut, len(want)):
                return False, f"{about}: streamed tokens {tokens} are not the offline ones {want} (cut after {cut})"
            if cut is None and text != o.outputs[0].text:
                return False, f"{about}: streamed text {text!r} is not the offline {o.outputs[0].text!r}"
        if leaked:
            return False, f"{about}: {leaked} KV blocks still held after every stream ended"
    if k is not None:
        for r, (o, want) in enumerate(zip(greedy, hf_logprobs)):
            entries = o.prompt_logprobs[1:] + o.outputs[0].logprobs  # the first prompt token has none
            if len(entries) != len(want) or any(not k <= len(e) <= k + 1 for e in entries):
                return False, f"{about}: logprobs of {len(entries)} tokens, {[len(e) for e in entries]} each"
            if r in tied:  # HF's rows after the tie saw another token
                entries = entries[:len(o.prompt_logprobs) + tied[r]]
            got = [(row, tid, lp.logprob) for row, e in enumerate(entries) for tid, lp in e.items()]
            worst = max(abs(lp - want[row, tid].item()) for row, tid, lp in got)
            if worst > tol:  # fp32 rounding, magnified, or a fault: which one is nearer the same model in fp64?
                truth = fp64_logprobs(hf, inputs[r]["prompt_token_ids"] + expected[r])
                ours = max(abs(lp - truth[row, tid].item()) for row, tid, lp in got)
                theirs = max(abs(want[row, tid].item() - truth[row, tid].item()) for row, tid, _ in got)
                if ours > theirs + tol:
                    return False, f"{about}: logprobs={k} off HF's log-softmax by up to {worst:.2e}, off its fp64 " \
                                  f"ones by {ours:.2e} where its own are {theirs:.2e}"
                about += f"; logprobs {worst:.1e} off HF's, {ours:.1e} off its fp64 ones (its own {theirs:.1e})"
    for i, params, d, r in zip(inputs, sampled, drawn, reference):
        if len(d.outputs) != params.n or len(r.outputs) != params.n:
            return False, f"{about}: {len(d.outputs)} and {len(r.outputs)} completions for n={params.n}"
        for c, (dc, rc) in enumerate(zip(d.outputs, r.outputs)):
            if dc.token_ids == rc.token_ids:
                continue
            margin = draw_margin(hf, i["prompt_token_ids"], dc.token_ids, rc.token_ids, params, c)
            if margin > 1e-5:
                return False, f"{about}: seeded samples differ from one stage's, {margin:.1e} from a tie"
            about += f"; a draw within {margin:.1e} of a tie went both ways"
    return True, about


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0, help="the first run's seed; run i draws from seed + i")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--family", choices=[*FAMILIES, *ARCHS], default=None,
                        help="every run on this family's checkpoint (a new family's soak)")
    args = parser.parse_args()
    models, failed = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seed, args.seed + args.runs):
            try:
                ok, about = one_run(seed, models, tmp, args.family)
            except Exception as e:  # a run that breaks is a failed run; the others still go
                ok, about = False, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            print(f"{'ok' if ok else 'FAIL'} seed {seed}: {about}", flush=True)
            if not ok:
                failed.append(seed)
    print(f"{len(failed)} of {args.runs} runs failed: seeds {failed}" if failed else f"all {args.runs} runs passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
