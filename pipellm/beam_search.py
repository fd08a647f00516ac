"""Beam search, as vLLM's LLM.beam_search: each step runs every live beam for one token with its top 2 * beam_width
log-probabilities (the prefix cache keeps the full blocks of a beam's earlier tokens from running again) and keeps
each prompt's beam_width best continuations by cumulative log-probability. A beam that draws EOS is done, unless
ignore_eos. The beam_width best of the done and live beams come back, ranked by
cum_logprob / len(tokens) ** length_penalty (tokens: the prompt's and the beam's; an EOS not counted)."""
from dataclasses import dataclass

from tqdm import tqdm

from pipellm.outputs import Logprob
from pipellm.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    tokens: list[int]                   # the prompt's and the beam's, as vLLM's
    logprobs: list[dict[int, Logprob]]  # per generated token: the top 2 * beam_width of its step
    cum_logprob: float = 0.0            # of the generated tokens
    text: str | None = None             # tokens decoded, prompt included (None without a tokenizer)
    finish_reason: str | None = None    # "stop" (drew EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def _score(seq: BeamSearchSequence, eos_ids: set[int], length_penalty: float) -> float:
    length = len(seq.tokens) - (seq.tokens[-1] in eos_ids)  # an EOS does not count, as in vLLM
    return seq.cum_logprob / length ** length_penalty


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    """prompts: token ids. llm: a pipellm.LLM (its generate runs each step)."""
    engine = llm.engine
    width, cap = params.beam_width, engine.config.max_logprobs
    if 0 <= cap < 2 * width:
        raise ValueError(f"beam_width={width} ranks the top {2 * width} log-probabilities a step, more than the "
                         f"engine's max_logprobs={cap}: start it with max_logprobs={2 * width} (or -1)")
    eos = set() if params.ignore_eos else engine.eos_token_ids
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width)
    for p in prompts:  # every prompt refused before any runs
        engine.inputs.validate(p, step)
    beams = [[BeamSearchSequence(list(p), [])] for p in prompts]   # per prompt: its live beams
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    # a prompt's beams stop growing at max_tokens, or where one more token would pass max_model_len
    steps = [min(params.max_tokens, engine.max_model_len - len(p)) for p in prompts]
    for i in tqdm(range(max(steps)), desc="Beam search", unit="step", disable=not use_tqdm):
        live = [(k, b) for k, bs in enumerate(beams) if i < steps[k] for b in bs]
        if not live:
            break
        outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in live], step, use_tqdm=False)
        grown: dict[int, list[BeamSearchSequence]] = {k: [] for k, _ in live}
        for (k, beam), out in zip(live, outs):
            entry = out.outputs[0].logprobs[0]
            for token, lp in entry.items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + lp.logprob)
                if token in eos:
                    seq.finish_reason = "stop"
                    done[k].append(seq)
                else:
                    grown[k].append(seq)
        for k, seqs in grown.items():
            beams[k] = sorted(seqs, key=lambda s: s.cum_logprob, reverse=True)[:width]
    results = []
    for live_beams, finished in zip(beams, done):
        for seq in live_beams:
            seq.finish_reason = "length"
        best = sorted(finished + live_beams, key=lambda s: _score(s, eos, params.length_penalty), reverse=True)[:width]
        for seq in best:
            seq.text = engine.tokenizer.decode(seq.tokens) if engine.tokenizer is not None else None
        results.append(BeamSearchOutput(best))
    return results
