"""The driver's output side (vLLM's OutputProcessor): sampled tokens applied to their requests, stop conditions,
log-probabilities, text through each request's incremental detokenizer, and the RequestOutput a user gets."""
import time

from pipellm.engine.detokenizer import IncrementalDetokenizer
from pipellm.engine.scheduler import ScheduledBatch, Scheduler
from pipellm.engine.sequence import Request
from pipellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], scheduler: Scheduler):
        self.tokenizer, self.eos_token_ids, self.scheduler = tokenizer, eos_token_ids, scheduler

    def add_tokens(self, owners: list[Request], tokens: list) -> int:
        """Each sampled token to the request that owns it, in order, each checked for a stop; a finished request's
        later tokens are dropped. Returns how many were added."""
        now, added = time.monotonic(), 0
        for req, tok in zip(owners, tokens):
            if req.is_finished:  # the tokens after the one that ended it are dropped
                continue
            if req.num_ahead:  # the token a batch still out already took as input
                req.num_ahead -= 1
            req.output_token_ids.append(tok.token_id)
            req.token_times.append(now)
            added += 1
            if req.params.logprobs is not None:
                self._add_logprobs(req, tok)
            self._check_stop(req)
        return added

    def _add_logprobs(self, req: Request, tok) -> None:
        entry = {tid: Logprob(lp, rank + 1, self._decode_token(tid)) for rank, (tid, lp) in enumerate(tok.top_logprobs)}
        entry[tok.token_id] = Logprob(tok.logprob, tok.rank, self._decode_token(tok.token_id))
        req.output_logprobs.append(entry)
        req.cumulative_logprob += tok.logprob

    def add_prompt_logprobs(self, batch: ScheduledBatch, lps) -> None:
        row = 0
        for req, first, count in batch.prompt_spans:
            k = req.params.prompt_logprobs
            for pos in range(first, first + count):
                entry = {int(tid): Logprob(float(lp), rank + 1, self._decode_token(int(tid)))
                         for rank, (tid, lp) in enumerate(zip(lps.top_ids[row, :k], lps.top_logprobs[row, :k]))}
                tid = req.prompt_token_ids[pos]
                entry[tid] = Logprob(float(lps.logprobs[row]), int(lps.ranks[row]), self._decode_token(tid))
                req.prompt_logprobs[pos] = entry
                row += 1

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _check_stop(self, req: Request) -> None:
        params, token = req.params, req.output_token_ids[-1]
        if len(req.output_token_ids) < params.min_tokens:
            # The sampler kept EOS and the stop tokens out. Stop strings wait too (as in vLLM): the text is read as
            # it comes, so that the search below later starts at the text after min_tokens.
            if params.stop:
                self.text(req)
        elif token in self.eos_token_ids and not params.ignore_eos:
            return self.scheduler.finish(req, "stop")
        elif token in params.stop_token_ids:
            req.stop_reason = token
            return self.scheduler.finish(req, "stop")
        elif params.stop:
            before = len(req.detok.text) if req.detok is not None else 0
            text = self.text(req)
            # a stop string can span tokens: search the new text and the tail before it that could start one
            start = max(0, before - max(map(len, params.stop)) + 1)
            for stop in params.stop:
                at = text.find(stop, start)
                if at != -1:
                    req.text, req.stop_reason = text[:at + len(stop) * params.include_stop_str_in_output], stop
                    return self.scheduler.finish(req, "stop")
        if len(req.output_token_ids) >= req.max_tokens:
            self.scheduler.finish(req, "length")

    def text(self, req: Request) -> str:
        """The request's output text so far, through its incremental detokenizer (made on first use): a request
        with stop strings, or one the server streams, reads its text every step. Whole once the request finished."""
        if self.tokenizer is None:
            return ""
        if req.detok is None:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        ids = self._text_ids(req)
        req.detok.update(ids[len(req.detok.token_ids):], final=req.is_finished)
        return req.detok.text

    @staticmethod
    def _text_ids(req: Request) -> list[int]:
        """The tokens the text shows: as vLLM's, not the EOS or stop token that ended it (its text would show where
        special tokens are kept), unless include_stop_str_in_output."""
        ids = req.output_token_ids
        if req.finish_reason == "stop" and not isinstance(req.stop_reason, str) \
                and not req.params.include_stop_str_in_output:
            return ids[:-1]
        return ids

    def completion(self, req: Request) -> CompletionOutput:
        if isinstance(req.stop_reason, str):
            text = req.text
        elif req.detok is not None or self.tokenizer is None:
            text = self.text(req)
        else:  # never read before: one decode of the whole output costs less than a window per token
            text = self.tokenizer.decode(self._text_ids(req), skip_special_tokens=req.params.skip_special_tokens)
        return CompletionOutput(req.index, text, list(req.output_token_ids), req.finish_reason, req.stop_reason,
                                list(req.output_logprobs) if req.params.logprobs is not None else None,
                                req.cumulative_logprob if req.params.logprobs is not None else None)

    def output(self, request_id: str, prompt: str | None, reqs: list[Request]) -> RequestOutput:
        """A user's request (its completions: reqs) as a RequestOutput."""
        return RequestOutput(request_id, prompt, reqs[0].prompt_token_ids, [self.completion(r) for r in reqs],
                             finished=all(r.is_finished for r in reqs),
                             metrics=RequestMetrics(reqs[0].arrival_time, list(reqs[0].token_times)),
                             prompt_logprobs=reqs[0].prompt_logprobs, lora_request=reqs[0].lora_request)
