"""Beam search, as vLLM's: each step runs every live beam for one token with its top 2 * beam_width
log-probabilities (the prefix cache holds a beam's earlier tokens, its parent's partial last block included, so
each beam computes one token a step) and keeps each prompt's beam_width best continuations by cumulative
log-probability. A beam that draws EOS is done, unless ignore_eos. The beam_width best of the done and live beams
come back, ranked by cum_logprob / len(tokens) ** length_penalty (tokens: the prompt's and the beam's; an EOS not
counted).

BeamSearch holds the beams; its drivers run each step: beam_search() on LLM.generate, beam_search_async() on the
server's AsyncEngine."""
import asyncio
from contextlib import aclosing
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


class BeamSearch:
    """The beams of one search over several prompts. Each step: run live()'s beams for one token with step_params,
    then advance() with each one's log-probabilities; when live() is empty, results() ranks them."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int, max_logprobs: int, logprobs: int = 0):
        """logprobs: how many top log-probabilities each step returns beyond the 2 * beam_width it ranks (a server's
        request reports them); the ranking stays the same."""
        width = params.beam_width
        if 0 <= max_logprobs < 2 * width:
            raise ValueError(f"beam_width={width} ranks the top {2 * width} log-probabilities a step, more than the "
                             f"engine's max_logprobs={max_logprobs}: start it with max_logprobs={2 * width} "
                             f"(--max-logprobs {2 * width}; -1: no cap)")
        self.params, self.eos = params, set() if params.ignore_eos else eos_token_ids
        self.step_params = SamplingParams(max_tokens=1, temperature=params.temperature,
                                          logprobs=max(2 * width, logprobs))
        self.beams = [[BeamSearchSequence(list(p), [])] for p in prompts]   # per prompt: its live beams
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        # a prompt's beams stop growing at max_tokens, or where one more token would pass max_model_len
        self.steps = [min(params.max_tokens, max_model_len - len(p)) for p in prompts]
        self.step = 0

    def live(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every beam the next step runs; empty when the search is over."""
        return [(k, b) for k, bs in enumerate(self.beams) if self.step < self.steps[k] for b in bs]

    def advance(self, live: list[tuple[int, BeamSearchSequence]], entries: list[dict[int, Logprob]],
                sampled: list[int]) -> None:
        """entries: per beam of live, its step's top log-probabilities; sampled: the token each step drew. The
        candidates are the top 2 * beam_width and the drawn token, as vLLM's."""
        grown: dict[int, list[BeamSearchSequence]] = {k: [] for k, _ in live}
        ranked = 2 * self.params.beam_width
        for (k, beam), entry, drawn in zip(live, entries, sampled):
            for token, lp in entry.items():
                if lp.rank > ranked and token != drawn:
                    continue
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + lp.logprob)
                if token in self.eos:
                    seq.finish_reason = "stop"
                    self.done[k].append(seq)
                else:
                    grown[k].append(seq)
        for k, seqs in grown.items():
            self.beams[k] = sorted(seqs, key=lambda s: s.cum_logprob, reverse=True)[:self.params.beam_width]
        self.step += 1

    def results(self) -> list[BeamSearchOutput]:
        """Per prompt, its beam_width best beams, done or not (text unset)."""
        outs = []
        for live_beams, finished in zip(self.beams, self.done):
            for seq in live_beams:
                seq.finish_reason = "length"
            best = sorted(finished + live_beams, key=self._score, reverse=True)[:self.params.beam_width]
            outs.append(BeamSearchOutput(best))
        return outs

    def _score(self, seq: BeamSearchSequence) -> float:
        length = len(seq.tokens) - (seq.tokens[-1] in self.eos)  # an EOS does not count, as in vLLM
        return seq.cum_logprob / length ** self.params.length_penalty


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams, use_tqdm: bool,
                lora_request=None) -> list[BeamSearchOutput]:
    """LLM.beam_search. prompts: token ids. llm: a pipellm.LLM (its generate runs each step)."""
    engine = llm.engine
    engine.check_lora(lora_request)
    search = BeamSearch(prompts, params, engine.eos_token_ids, engine.max_model_len, engine.config.max_logprobs)
    for p in prompts:  # every prompt refused before any runs
        engine.inputs.validate(p, search.step_params)
    with tqdm(total=max(search.steps), desc="Beam search", unit="step", disable=not use_tqdm) as bar:
        while live := search.live():
            outs = llm.generate([{"prompt_token_ids": b.tokens} for _, b in live], search.step_params,
                                use_tqdm=False, lora_request=lora_request)
            search.advance(live, [out.outputs[0].logprobs[0] for out in outs],
                           [out.outputs[0].token_ids[0] for out in outs])
            bar.update()
    results = search.results()
    for out in results:
        for seq in out.sequences:
            seq.text = engine.tokenizer.decode(seq.tokens) if engine.tokenizer is not None else None
    return results


async def beam_search_async(engine, request_id: str, search: BeamSearch, priority: int = 0,
                            lora_request=None) -> list[BeamSearchOutput]:
    """Runs a search's steps on an AsyncEngine, each beam a request of its own. Cancelling it aborts the step's
    requests."""
    while live := search.live():
        steps = await asyncio.gather(*(_one_step(engine, f"{request_id}-{search.step}-{j}", beam.tokens,
                                                 search.step_params, priority, lora_request)
                                       for j, (_, beam) in enumerate(live)))
        search.advance(live, [entry for entry, _ in steps], [token for _, token in steps])
    return search.results()


async def _one_step(engine, request_id: str, tokens: list[int], params: SamplingParams,
                    priority: int, lora_request=None) -> tuple[dict[int, Logprob], int]:
    """One token for one beam: (its top log-probabilities, the token drawn)."""
    entries, drawn = [], []
    async with aclosing(engine.generate(request_id, tokens, params, priority, lora_request)) as stream:
        async for deltas in stream:
            for d in deltas:
                entries += d.logprobs or []
                drawn += d.token_ids
    return entries[0], drawn[0]
