"""Messages between the driver and the stage processes. Each carries only what the receiver needs."""
from dataclasses import dataclass, field

import numpy as np

from pipellm.config import MAX_SCHEDULER_STEPS, EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline.partition import StageLayers
from pipellm.quant.linear import MAPPED
from pipellm.sampler import PromptLogprobs, SampledToken
from pipellm.sampling_params import SamplingParams


AHEAD_TOKEN = -1  # input id of a token the stage sampled for the request in the batch before (async scheduling)
MAX_ROWS = 1 << 16  # rows the driver may use (it reuses the rows of finished requests: at most ~2x max_num_seqs),
#                     and slots of saved states


@dataclass
class StageArgs:
    """Driver -> a starting stage, through the rendezvous store: what to load and run."""
    stage: StageLayers
    num_stages: int
    model_dir: str                   # the driver's path; a stage on another host may be given its own
    model_config: ModelConfig
    engine_config: EngineConfig
    num_blocks: int
    num_window_blocks: int = 0       # blocks of the sliding-window layers' own caches (0: they share num_blocks)


@dataclass
class NewRequest:
    """Sampling state the last stage keeps for a request from its first step until it finishes."""
    req_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    seed: int
    output_token_ids: list[int] = field(default_factory=list)  # tokens generated before a pipeline restart
    min_tokens_stop_ids: list[int] = field(default_factory=list)  # EOS and stop tokens, masked before
    #                                                                params.min_tokens new tokens
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized


@dataclass
class BlockTableChanges:
    """How a batch's block tables differ from what the stages hold. Every stage keeps a table row per sequence that
    holds blocks (the driver assigns rows), and each batch brings only the block ids added since the row was last
    sent: a decode step sends none but a new block's, where a whole table a sequence was re-sent every step."""
    rows: np.ndarray                 # [B] int64 each sequence's row
    keep: np.ndarray                 # [B] the row's first blocks that stay (0: a row newly given to a sequence)
    num_new: np.ndarray              # [B] block ids appended after those
    new_ids: np.ndarray              # [sum of num_new] int32, sequence after sequence


@dataclass
class LoRALoad:
    """An adapter every stage loads into a LoRA slot before running the batch (the engine's enable_lora)."""
    slot: int
    path: str                        # the PEFT folder, on every host at this path


@dataclass
class StageBatch:
    """One step of work, driver -> every stage. T = new tokens, B = sequences, S = sequences sampled."""
    batch_id: int
    input_ids: np.ndarray | None     # [T] int64; only the first stage gets it
    positions: np.ndarray            # [T] int64
    slot_mapping: np.ndarray         # [T] int64 flat KV cache slot of each new token
    query_lens: np.ndarray           # [B] new tokens per sequence
    seq_lens: np.ndarray             # [B] context length after this step
    block_tables: np.ndarray | None  # [B, max_blocks] int32, padded with 0: sent whole, or built by each stage
    #                                  from table_changes
    logits_indices: np.ndarray       # [S] token rows whose logits are sampled (last stage)
    sample_req_ids: list[str] = field(default_factory=list)    # [S] (last stage)
    new_requests: list[NewRequest] = field(default_factory=list)  # first step of a request (last stage)
    finished_req_ids: list[str] = field(default_factory=list)     # sampling state to drop (last stage)
    rope_lens: np.ndarray | None = None  # [B] each sequence's known length (prompt + output): what dynamic and
    #                                      longrope rotary scale by, as HF does for the sequence it runs
    window_block_tables: np.ndarray | None = None  # [B, ring] int32: the sliding-window layers' block rings
    probe: bool = False              # record what every layer does (LLM.inspect): each stage sends a ProbeReport
    prompt_rows: np.ndarray | None = None     # [R] rows whose logits score the next prompt token (last stage)
    prompt_targets: np.ndarray | None = None  # [R] those next prompt tokens
    prompt_top_k: int = 0                     # most likely tokens returned beside each (the batch's largest k)
    ahead_req_ids: list[str] = field(default_factory=list)  # [A] requests whose input is the token the stage
    #                                  sampled for them in the batch before (async scheduling, one stage): in order,
    #                                  one for each AHEAD_TOKEN of input_ids
    num_steps: int = 1               # decode steps in a row, each step's samples the next one's input_ids (the
    #                                  last stage sends them to the first); every row a decode; block_tables cover
    #                                  them all
    table_changes: BlockTableChanges | None = None
    draft_token_ids: np.ndarray | None = None  # [S] int64 (speculative decoding): the draft each logits row
    #                                  verifies, -1 on a sampled request's last row; its rows before that hold drafts
    block_copies: np.ndarray | None = None  # [C, 2] int64 (source, destination): KV blocks every stage copies in
    #                                  each of its layers before running the batch (a kept partial block's copy)
    state_loads: np.ndarray | None = None  # [L, 2] int64 (slot, row): saved states every linear-attention layer
    #                                  copies into a sequence's row before running the batch (a cached prefix's)
    state_saves: np.ndarray | None = None  # [K, 3] int64 (sequence, k, slot): after its first k new tokens, a
    #                                  sequence's state is saved in the slot, in every linear-attention layer
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters into slots, before the batch runs
    lora_slots: np.ndarray | None = None  # [B] int64 each sequence's LoRA slot, -1 for none (None: all none)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def check(self, num_blocks: int, block_size: int, vocab_size: int, is_first: bool, is_last: bool,
              num_window_blocks: int = 0, max_loras: int = 0) -> None:
        """ValueError unless the arrays agree with each other and index only this stage's caches and vocabulary."""
        def need(ok, what):
            if not ok:
                raise ValueError(f"StageBatch {self.batch_id}: {what}")

        T, B = len(self.positions), len(self.query_lens)
        need(self.block_tables is not None, "no block_tables: neither sent nor built from table_changes")
        for name in ("positions", "slot_mapping", "query_lens", "seq_lens", "logits_indices"):
            a = getattr(self, name)
            need(a.ndim == 1 and a.dtype.kind == "i", f"{name} must be a 1-D integer array")
        need(self.block_tables.ndim == 2 and self.block_tables.dtype.kind == "i" and len(self.block_tables) == B,
             "block_tables must be [sequences, blocks] integers")
        need(len(self.slot_mapping) == T and len(self.seq_lens) == B, "arrays of different lengths")
        need(self.rope_lens is None or (self.rope_lens.shape == (B,) and self.rope_lens.dtype.kind == "i"
                                        and (self.rope_lens >= self.seq_lens).all()), "rope_lens out of range")
        need(T > 0 and int(self.query_lens.sum()) == T and (self.query_lens >= 1).all(), "query_lens do not sum to "
             "the token count")
        need((self.seq_lens >= self.query_lens).all() and
             (self.seq_lens <= self.block_tables.shape[1] * block_size).all(), "seq_lens out of range")
        need((self.positions >= 0).all() and (self.positions < self.seq_lens.max()).all(), "positions out of range")
        need((self.slot_mapping >= 0).all() and (self.slot_mapping < num_blocks * block_size).all() and
             (self.block_tables >= 0).all() and (self.block_tables < num_blocks).all(),
             f"KV slots or blocks outside this stage's {num_blocks} blocks")
        c = self.block_copies
        need(c is None or (c.ndim == 2 and c.shape[1] == 2 and c.dtype.kind == "i" and (c >= 0).all()
                           and (c < num_blocks).all() and num_window_blocks == 0),
             f"block_copies must be [copies, 2] blocks below {num_blocks}, in caches without sliding-window rings")
        loads, saves = self.state_loads, self.state_saves
        need(loads is None or (loads.ndim == 2 and loads.shape[1] == 2 and loads.dtype.kind == "i"
                               and (loads >= 0).all() and (loads < MAX_ROWS).all()),
             f"state_loads must be [loads, 2] (slot, row) below {MAX_ROWS}")
        need(saves is None or (saves.ndim == 2 and saves.shape[1] == 3 and saves.dtype.kind == "i"
                               and self.num_steps == 1 and (saves >= 0).all() and (saves[:, 0] < B).all()
                               and (saves[:, 2] < MAX_ROWS).all()
                               and (saves[:, 1] >= 1).all() and (saves[:, 1] <= self.query_lens[saves[:, 0]]).all()
                               and (np.diff(saves[:, 0] * (1 << 32) + saves[:, 1]) > 0).all()),
             f"state_saves must be [saves, 3] (sequence, tokens, slot), in order: within its new tokens, a slot below "
             f"{MAX_ROWS}")
        ls = self.lora_slots
        need(ls is None or (ls.shape == (B,) and ls.dtype.kind == "i" and ((ls >= -1) & (ls < max_loras)).all()),
             f"lora_slots must be [sequences] slots below max_loras={max_loras}, or -1")
        need(all(type(x.slot) is int and 0 <= x.slot < max_loras and isinstance(x.path, str)
                 for x in self.lora_loads), f"lora_loads must name slots below max_loras={max_loras}")
        if self.window_block_tables is not None:
            need(self.window_block_tables.ndim == 2 and self.window_block_tables.dtype.kind == "i" and
                 len(self.window_block_tables) == B and (self.window_block_tables >= 0).all() and
                 (self.window_block_tables < num_window_blocks).all(), "window_block_tables out of range")
        need(not self.probe or B == 1, "a probe batch holds one sequence")
        if self.num_steps != 1:
            need(isinstance(self.num_steps, int) and 1 < self.num_steps <= MAX_SCHEDULER_STEPS and T == B
                 and np.array_equal(self.logits_indices, np.arange(B)) and self.prompt_rows is None
                 and not self.probe and self.window_block_tables is None and self.rope_lens is None,
                 f"num_steps must be 1 to {MAX_SCHEDULER_STEPS}, and above 1 only when every row decodes")
            need((self.seq_lens + self.num_steps - 1 <= self.block_tables.shape[1] * block_size).all(),
                 "block_tables do not cover num_steps")
        if is_first:
            ids = self.input_ids
            need(ids is not None and ids.shape == (T,) and ids.dtype.kind == "i" and (ids < vocab_size).all() and
                 ((ids >= 0) | (ids == AHEAD_TOKEN)).all(), f"input_ids must be [tokens] ids below {vocab_size}")
            need(int((ids == AHEAD_TOKEN).sum()) == len(self.ahead_req_ids) and (is_last or not self.ahead_req_ids)
                 and (self.num_steps == 1 or not self.ahead_req_ids),
                 "ahead_req_ids must name one request for each AHEAD_TOKEN in input_ids, on a stage that samples")
        if is_last:
            need(len(self.sample_req_ids) == len(self.logits_indices) and
                 ((self.logits_indices >= 0) & (self.logits_indices < T)).all(), "logits_indices out of range")
            d = self.draft_token_ids
            need(d is None or (d.shape == self.logits_indices.shape and d.dtype.kind == "i" and len(d) > 0
                               and d[-1] == -1 and ((d >= -1) & (d < vocab_size)).all() and self.num_steps == 1
                               and all(self.sample_req_ids[i] == self.sample_req_ids[i + 1]
                                       for i in np.flatnonzero(d >= 0).tolist())),
                 "draft_token_ids must give each logits row's draft, -1 on each request's last row")
            need((self.prompt_rows is None) == (self.prompt_targets is None), "prompt_rows without prompt_targets")
            if self.prompt_rows is not None:
                rows, targets = self.prompt_rows, self.prompt_targets
                need(rows.ndim == 1 and rows.dtype.kind == "i" and rows.shape == targets.shape and
                     targets.dtype.kind == "i" and ((rows >= 0) & (rows < T)).all() and
                     ((targets >= 0) & (targets < vocab_size)).all() and 0 <= self.prompt_top_k <= vocab_size,
                     "prompt_rows or prompt_targets out of range")


def num_drafts(draft_token_ids: np.ndarray | None) -> np.ndarray | None:
    """[requests sampled] the drafts each verifies, from StageBatch.draft_token_ids (None: a batch without)."""
    if draft_token_ids is None:
        return None
    ends = np.flatnonzero(draft_token_ids == -1)                                   # each request's last row
    return np.diff(ends, prepend=-1) - 1


@dataclass
class SampledBatch:
    """Last stage -> driver: one sampled token per entry of StageBatch.sample_req_ids, per step (step by step). With
    drafts, per sampled request its accepted drafts and the token after them."""
    batch_id: int
    tokens: list[SampledToken]
    prompt_logprobs: PromptLogprobs | None = None  # for StageBatch.prompt_rows, in their order
    num_accepted: np.ndarray | None = None  # [requests sampled] int64: drafts kept, where the batch had drafts

    def check(self, vocab_size: int, num_tokens: int, num_prompt_rows: int | None = None, top_k: int = 0,
              num_drafts: np.ndarray | None = None) -> None:
        if num_drafts is not None:  # num_tokens: one a request, and one more for each draft it keeps
            a = self.num_accepted
            if a is None or a.shape != num_drafts.shape or a.dtype.kind != "i" or not (
                    (a >= 0) & (a <= num_drafts)).all():
                raise ValueError(f"SampledBatch {self.batch_id}: num_accepted must give each request's drafts kept")
            num_tokens = len(num_drafts) + int(a.sum())
        elif self.num_accepted is not None:
            raise ValueError(f"SampledBatch {self.batch_id}: num_accepted for a batch without drafts")
        if len(self.tokens) != num_tokens:
            raise ValueError(f"SampledBatch {self.batch_id}: {len(self.tokens)} tokens where the batch samples "
                             f"{num_tokens}")
        if any(not 0 <= t.token_id < vocab_size for t in self.tokens):
            raise ValueError(f"SampledBatch {self.batch_id}: token ids outside the vocabulary of {vocab_size}")
        p = self.prompt_logprobs
        if (p is None) != (num_prompt_rows is None) or p is not None and not (
                p.logprobs.shape == p.ranks.shape == (num_prompt_rows,) and
                p.top_ids.shape == p.top_logprobs.shape == (num_prompt_rows, min(top_k, vocab_size)) and
                ((p.top_ids >= 0) & (p.top_ids < vocab_size)).all()):
            raise ValueError(f"SampledBatch {self.batch_id}: prompt log-probabilities do not match the batch")


@dataclass
class ProbeReport:
    """A stage -> driver after a probe batch: what its own layers (L of them) did with the batch's one sequence."""
    batch_id: int
    stage: int
    attention: np.ndarray | None     # [L, KV, K] float32 when the sequence decodes: its new token's attention weights
    #                                  over the K cached positions, per KV head (its query heads averaged)
    kv_blocks: list[list[int]]       # [L][blocks] the cache blocks each layer read for the sequence
    kv_key_rms: list[list[float]]    # [L][positions] root mean square of each cached key, read through those blocks
    lens_ids: np.ndarray | None = None      # last stage, [layers of the model, T] int64: the token that norm +
    #                                         LM head rank first from each layer's output, for every row
    lens_probs: np.ndarray | None = None    # [layers of the model, T] float32: its probability
    sampled_probs: np.ndarray | None = None  # [layers of the model, S] float32: each sampled token's probability

    def check(self, stage_layers: int, num_layers: int, num_tokens: int, num_sampled: int, is_last: bool) -> None:
        def need(ok, what):
            if not ok:
                raise ValueError(f"ProbeReport of stage {self.stage}: {what}")

        need(len(self.kv_blocks) == stage_layers == len(self.kv_key_rms), "one block list per layer expected")
        need(self.attention is None or (self.attention.ndim == 3 and len(self.attention) == stage_layers),
             "attention must be [layers, kv heads, positions]")
        if is_last:
            for name, cols in (("lens_ids", num_tokens), ("lens_probs", num_tokens), ("sampled_probs", num_sampled)):
                a = getattr(self, name)
                need(a is not None and a.shape == (num_layers, cols), f"{name} must be [{num_layers}, {cols}]")


@dataclass
class Inspect:
    """Driver -> every stage: report what you hold (tests and diagnostics)."""


@dataclass
class Shutdown:
    """Driver -> every stage: exit the loop."""


@dataclass
class StageReport:
    rank: int                        # stage index, 0-based
    description: str                 # e.g. "stage 0: embed + layers 0-14"
    pid: int
    param_names: list[str]           # parameters of this stage's model slice
    checkpoint_tensors: list[str]    # checkpoint tensors this stage read
    model_dir: str                   # ... from this copy of the checkpoint
    num_kv_caches: int               # K/V cache pairs (or linear-attention states), one per layer held
    kv_cache_shape: tuple[int, ...]  # [num_blocks, block_size, num_kv_heads, head_dim]; () with states only
    num_threads: int
    cpu_affinity: list[int]
    steps: int                       # batches processed
    activation_bytes_sent: int       # bytes of hidden states sent to the next stage
    activation_tokens_sent: int      # token rows in those hidden states
    busy_s: float                    # seconds spent computing (model, logits, sampling), not waiting
    events: list[tuple] | None = None  # trace events since the last report, when tracing
    clock_offset_s: float = 0.0      # wall clock minus this process's perf_counter, to align events
    weight_bytes: list[tuple[str, int]] = field(default_factory=list)  # (format, bytes) of the weights held
    kv_cache_bytes: int = 0
    rss_bytes: int = 0               # resident memory of the whole process (host memory)
    device: str = "cpu"              # where its weights and KV cache live

    def describe_memory(self) -> str:
        """e.g. "61 MB weights (Q4_1, F32), 64 MB KV cache, 350 MB resident"; on a GPU "... KV cache on cuda:0, ...";
        an embedding left in the file adds "+ 30 MB file-mapped (Q8_0)" after the weights held."""
        mb = (lambda n: f"{n / 1e6:.0f} MB")
        held = [(f, n) for f, n in self.weight_bytes if not f.endswith(MAPPED)]
        mapped = [(f.removesuffix(MAPPED), n) for f, n in self.weight_bytes if f.endswith(MAPPED)]
        text = f"{mb(sum(n for _, n in held))} weights ({', '.join(f for f, _ in held)})"
        if mapped:
            text += f" + {mb(sum(n for _, n in mapped))} file-mapped ({', '.join(f for f, _ in mapped)})"
        where = "" if self.device == "cpu" else f" on {self.device}"
        return f"{text}, {mb(self.kv_cache_bytes)} KV cache{where}, {mb(self.rss_bytes)} resident"
