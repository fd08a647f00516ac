import enum
import time
from dataclasses import dataclass, field

import numpy as np

from pipellm.engine.detokenizer import IncrementalDetokenizer
from pipellm.lora import LoRARequest
from pipellm.outputs import Logprob
from pipellm.pipeline.messages import AHEAD_TOKEN
from pipellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to recompute
    RUNNING = "running"      # holds KV blocks
    FINISHED = "finished"


# eq=False: a request is one object; `in` and remove() on the scheduler's lists compare identities, not every field
@dataclass(eq=False)
class Request:
    """One sequence being generated: its tokens, how many of them the KV cache holds, and its blocks."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                        # generator seed for sampling
    max_tokens: int                  # new tokens allowed, already capped by max_model_len
    index: int = 0                   # which of the params.n completions this is
    parent_id: str | None = None     # the user's request id when params.n > 1
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0                # scheduling_policy "priority": lower runs first
    output_token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() at which each output token arrived
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token, when asked for
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    window_block_ids: list[int] = field(default_factory=list)  # the ring its sliding-window layers cycle through
    table_row: int = -1              # its row in the stages' block tables while it holds blocks
    blocks_sent: int = 0             # of its block_ids, those its row already holds
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its first full blocks (lazy)
    status: RequestStatus = RequestStatus.WAITING
    in_flight: int = 0               # batches out that hold it (two with async scheduling: one runs ahead)
    num_ahead: int = 0               # tokens a batch out will sample that a batch after it already takes as
    #                                  input (async scheduling): counted in num_tokens, their ids still unknown
    is_known_to_sampler: bool = False  # the last stage holds its sampling state
    num_preemptions: int = 0
    suspect: bool = False            # it was out when a stage failed: until a batch that samples it comes back, it
    #                                  runs with no other suspect out, and a failure then drops it (drop_suspects)
    use_prefix_cache: bool = True    # False: compute every prompt position, even where a cached prefix holds it
    lora_request: LoRARequest | None = None  # the adapter it runs with (enable_lora)
    lora_slot: int = -1              # the stages' slot holding that adapter, while it runs
    cache_salt: bytes = b""          # what its first block's hash starts from: a cached prefix of another adapter's
    #                                  K/V is not its own
    state_saves: list[int] = field(default_factory=list)  # blocks after which the stages save its state (prefix
    #                                  caching of a model whose layers keep one), those its batches have not reached
    decode_saved: bytes | None = None  # the prefix whose state it saved last as it decoded
    min_tokens_stop_ids: list[int] = field(default_factory=list)  # what the sampler masks before params.min_tokens
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    draft_token_ids: list[int] = field(default_factory=list)  # speculated after its next token, in its batch out
    rope_len: int = 0                # num_tokens when its K/V was last computed (longrope: short or long factors)
    text: str = ""                   # the output text cut before a stop string, once one ended the request
    detok: IncrementalDetokenizer | None = None  # its output's text, kept up to date by OutputProcessor.text()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _tokens: np.ndarray | None = field(default=None, repr=False)  # token_array()'s buffer, room to grow
    _tokens_len: int = 0

    def token_array(self) -> np.ndarray:
        """prompt + output as int64 (the n-gram drafts search it every step): kept in a buffer that grows by the new
        output tokens, not built again from the lists (73 us at 4,096 tokens)."""
        n, total = len(self.prompt_token_ids), len(self.prompt_token_ids) + len(self.output_token_ids)
        buf, have = self._tokens, self._tokens_len
        if buf is None or have > total:  # first use (or outputs cut back): from the lists
            buf, have = np.empty(2 * total + 16, np.int64), n
            buf[:n] = self.prompt_token_ids
        elif total > len(buf):
            buf = np.concatenate([buf[:have], np.empty(2 * total - have, np.int64)])
        buf[have:total] = self.output_token_ids[have - n:]
        self._tokens, self._tokens_len = buf, total
        return buf[:total]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_ahead

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without joining the two lists: a decode step asks for one.
        A token still to come from a batch out (num_ahead) reads AHEAD_TOKEN."""
        n = len(self.prompt_token_ids)
        if start >= n:
            ids = self.output_token_ids[start - n:end - n]
        else:
            ids = self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - n)]
        if self.num_ahead:
            ids = ids + [AHEAD_TOKEN] * (min(end, self.num_tokens) - start - len(ids))
        return ids
