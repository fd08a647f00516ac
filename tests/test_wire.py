"""The wire format: every message survives the trip unchanged, and nothing but a signed, well-formed message of an
expected kind gets through. Random and hostile bytes only ever raise WireError, and never run code."""
import os
import pickle
import struct
from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipellm.config import EngineConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline import wire
from pipellm.pipeline.block_tables import StageBlockTables
from pipellm.pipeline.messages import (AHEAD_TOKEN, BlockTableChanges, Inspect, LoRALoad, NewRequest, ProbeReport,
                                       SampledBatch, Shutdown, StageArgs, StageBatch, StageReport)
from pipellm.pipeline.partition import make_partition
from pipellm.rope_config import RopeConfig
from pipellm.sampler import PromptLogprobs, SampledToken
from pipellm.sampling_params import SamplingParams, StructuredOutputsParams

KEY = b"k" * 32
CTX = b"pipellm/0/1>2#5"


def _batch(num_seqs: int = 3) -> StageBatch:
    q = np.array([4] + [1] * (num_seqs - 1), dtype=np.int64)
    seq_lens = q + np.arange(num_seqs, dtype=np.int64) * 5
    tables = np.arange(num_seqs * 4, dtype=np.int32).reshape(num_seqs, 4)[:, ::-1].copy()  # not in order
    T = int(q.sum())
    return StageBatch(9, np.arange(T, dtype=np.int64) % 50, np.arange(T, dtype=np.int64), np.arange(T, dtype=np.int64),
                      q, seq_lens, tables, np.cumsum(q) - 1, [f"req-{i}" for i in range(num_seqs)],
                      [NewRequest("req-0", SamplingParams(temperature=0.7, top_k=5, stop=["\n"], seed=3, min_tokens=2,
                                                          logit_bias={7: -1.5, 2: 100.0}), [1, 2, 3], 17, [4, 5],
                                  [0, 9], [[3, 4], [5]]),
                       NewRequest("req-1", SamplingParams(structured_outputs=StructuredOutputsParams(json={"a": 1})),
                                  [1], 18)], ["old"])


MESSAGES = [
    _batch(),
    replace(_batch(), block_tables=None,  # tables as changes: a new row, a row that keeps 2 blocks, an unchanged one
            table_changes=BlockTableChanges(np.array([4, 0, 7]), np.array([0, 2, 3]), np.array([2, 1, 0]),
                                            np.array([5, 9, 11], dtype=np.int32))),
    SampledBatch(9, [SampledToken(3, -0.25, 1, [(3, -0.25), (7, float("-inf"))]), SampledToken(4)]),
    replace(_batch(), sample_req_ids=["req-0", "req-0", "req-1"], logits_indices=np.array([2, 3, 4]),
            draft_token_ids=np.array([7, -1, -1])),  # speculative decoding: req-0's row 2 verifies a draft
    SampledBatch(11, [SampledToken(5), SampledToken(2), SampledToken(8)], None, np.array([1, 0])),
    SampledBatch(10, [], PromptLogprobs(np.array([-0.5, -2.0], np.float32), np.array([1, 4]),
                                        np.array([[3, 5], [7, 1]]), np.array([[-0.5, -1.0], [-0.1, -0.9]], np.float32))),
    StageArgs(make_partition(5, 2, [3, 2])[1], 2, "/models/x",
              ModelConfig("LlamaForCausalLM", 384, 64, 5, 4, 2, 16, 160, 256, 1e-5, RopeConfig("llama3", 5e5, factor=8.0, original_max_position_embeddings=64), eos_token_ids=(0, 2), layer_types=("full_attention",) * 5),
              EngineConfig("/models/x", pipeline_parallel_size=2, layer_partition=[3, 2], nnodes=2,
                           master_port=29500), 123),
    StageArgs(make_partition(30, 1)[0], 1, "/cache/smollm2",
              ModelConfig("LlamaForCausalLM", 49152, 576, 30, 9, 3, 64, 1536, 8192, 1e-5, RopeConfig(theta=1e5), True),
              EngineConfig(None, layer_partition="auto", dtype="bfloat16", num_kv_blocks=64), 64),  # default model
    StageReport(1, "stage 1: layers 3-4", 42, ["a.weight"], ["model.layers.3.x"], "/m", 2, (10, 16, 2, 16), 1, [1],
                7, 0, 0, 1.5, [("forward", 3, 0.5, 0.75, 12, 2)], 0.25, [("Q4_1", 1000), ("F32", 8)], 64, 4096),
    ProbeReport(4, 1, np.full((2, 2, 7), 1 / 7, np.float32), [[3], [3]], [[0.5] * 7, [1.0] * 7],
                np.zeros((5, 6), np.int64), np.ones((5, 6), np.float32), np.ones((5, 1), np.float32)),
    Inspect(),
    Shutdown(),
]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_comes_back_equal(msg):
    frame = wire.seal(KEY, CTX, wire.encode(msg))
    back = wire.decode(wire.unseal(KEY, CTX, frame, "stage 1"))
    assert _same(msg, back)
    if isinstance(back, StageBatch) and back.block_tables is not None:
        back.check(num_blocks=12, block_size=16, vocab_size=50, is_first=True, is_last=True)
        back.block_tables[0, 0] = 1  # arrays arrive writable (they become tensors)


def test_only_the_expected_kinds_are_accepted():
    with pytest.raises(wire.WireError, match="unexpected message kind 'Shutdown'; expected one of SampledBatch"):
        wire.decode(wire.encode(Shutdown()), (SampledBatch,))


def test_a_frame_needs_the_token_the_context_and_every_byte():
    frame = wire.seal(KEY, CTX, wire.encode(_batch()))
    for key, ctx, data in [(b"x" * 32, CTX, frame),              # another run's token
                           (KEY, b"pipellm/0/1>2#6", frame),      # replayed as the next message
                           (KEY, b"pipellm/1/1>2#5", frame),      # ... or in the next pipeline
                           (KEY, CTX, frame[:-1] + bytes([frame[-1] ^ 1])),
                           (KEY, CTX, frame[:40]), (KEY, CTX, b"")]:
        with pytest.raises(wire.WireError, match="from stage 1"):
            wire.unseal(key, ctx, data, "stage 1")


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_signed_pickle_is_refused_and_runs_nothing(tmp_path):
    canary = tmp_path / "canary"
    data = pickle.dumps(_Payload(canary))
    for payload in (data, struct.pack("<I", len(data)) + data):
        with pytest.raises(wire.WireError):
            wire.decode(wire.unseal(KEY, CTX, wire.seal(KEY, CTX, payload), "x"))
    assert not canary.exists()


def _header(kind, value, arrays=()) -> bytes:
    import json
    header = json.dumps({"kind": kind, "value": value, "arrays": list(arrays)}).encode()
    return struct.pack("<I", len(header)) + header


@pytest.mark.parametrize("payload, why", [
    (_header("os.system", []), "unexpected message kind"),
    (_header("SampledBatch", [1, [[3, None, None, None], "x"], None, None]), "SampledBatch"),
    (_header("SampledBatch", [1, [[True, None, None, None]], None, None]), "expected an integer"),
    (_header("SampledBatch", {"batch_id": 1, "tokens": []}), "expected a list of its 4 fields"),
    (_header("StageBatch", [0] * 11, [["|O", [1]]]), "bad array description"),
    (_header("StageBatch", [0] * 11, [["<i8", [2 ** 40, 2 ** 40]]]), "runs past the end"),
    (_header("StageBatch", [0] * 11, [["<i8", [1]]]) + b"\0" * 9, "bytes left over"),
    (_header("StageBatch", [None, 5] + [0] * (len(fields(StageBatch)) - 2), [["<i8", [1]]]) + b"\0" * 8,
     "batch_id"),
    (struct.pack("<I", 10 ** 6) + b"{}", "past the end"),
    (struct.pack("<I", 3) + b"[[[", "undecodable"),
    (struct.pack("<I", 20000) + b"[" * 20000, "undecodable"),  # deep nesting: RecursionError inside json
])
def test_malformed_payloads_say_what_is_wrong(payload, why):
    with pytest.raises(wire.WireError, match=why):
        wire.decode(payload)


def test_class_checks_run_on_arrival():
    params = wire.encode(SampledBatch(1, []))  # then a NewRequest whose SamplingParams are out of range
    batch = _batch()
    batch.new_requests[0].params.top_p = 5.0   # set after the constructor's check, as a hostile sender would
    with pytest.raises(wire.WireError, match="top_p"):
        wire.decode(wire.encode(batch))
    batch.new_requests[0].params.top_p = 1.0
    batch.new_requests[0].params.logit_bias = {"7": 1.0}
    with pytest.raises(wire.WireError, match="logit_bias"):
        wire.decode(wire.encode(batch))
    assert wire.decode(params).tokens == []


def test_stage_batch_check_refuses_out_of_range_indices():
    batch = wire.decode(wire.encode(_batch()))
    batch.check(12, 16, 50, True, True)
    for field, value, why in [("slot_mapping", 12 * 16, "KV slots"), ("block_tables", -1, "KV slots"),
                              ("input_ids", 50, "input_ids"), ("logits_indices", 99, "logits_indices")]:
        bad = wire.decode(wire.encode(_batch()))
        getattr(bad, field).flat[0] = value
        with pytest.raises(ValueError, match=why):
            bad.check(12, 16, 50, True, True)


def test_saved_states_travel_and_out_of_range_ones_are_refused():
    """Prefix caching of states: the loads (slot, row) and saves (sequence, after k of its new tokens, slot)."""
    batch = replace(_batch(), state_loads=np.array([[3, 1]]), state_saves=np.array([[0, 2, 5], [0, 4, 6], [2, 1, 0]]))
    back = wire.decode(wire.encode(batch))
    back.check(12, 16, 50, True, True)
    assert back.state_loads.tolist() == [[3, 1]] and back.state_saves.tolist() == [[0, 2, 5], [0, 4, 6], [2, 1, 0]]
    for change, why in [(dict(state_loads=np.array([[3, -1]])), "state_loads"),
                        (dict(state_loads=np.array([3, 1])), "state_loads"),
                        (dict(state_saves=np.array([[0, 5, 1]])), "within its new tokens"),  # 4 new tokens
                        (dict(state_saves=np.array([[1, 0, 1]])), "within its new tokens"),
                        (dict(state_saves=np.array([[3, 1, 1]])), "within its new tokens"),  # 3 sequences
                        (dict(state_saves=np.array([[0, 1, 1 << 16]])), "a slot below"),
                        (dict(state_saves=np.array([[0, 4, 6], [0, 2, 5]])), "in order")]:
        with pytest.raises(ValueError, match=why):
            replace(batch, **change).check(12, 16, 50, True, True)


def test_lora_fields_travel_and_out_of_range_ones_are_refused():
    """enable_lora: adapters loaded into slots, and each sequence's slot (-1: none)."""
    batch = replace(_batch(), lora_loads=[LoRALoad(1, "/adapters/a")], lora_slots=np.array([1, -1, 0]))
    back = wire.decode(wire.encode(batch))
    back.check(12, 16, 50, True, True, max_loras=2)
    assert back.lora_loads == [LoRALoad(1, "/adapters/a")] and back.lora_slots.tolist() == [1, -1, 0]
    for change in [dict(lora_slots=np.array([2, -1, 0])), dict(lora_slots=np.array([-2, -1, 0])),
                   dict(lora_slots=np.array([0, 0])), dict(lora_loads=[LoRALoad(2, "/adapters/a")])]:
        with pytest.raises(ValueError, match="lora_"):
            replace(batch, **change).check(12, 16, 50, True, True, max_loras=2)
    with pytest.raises(ValueError, match="lora_"):  # an engine without enable_lora: no slots at all
        batch.check(12, 16, 50, True, True)


def test_a_stage_builds_block_tables_from_changes_and_refuses_bad_ones():
    tables = StageBlockTables()
    first = BlockTableChanges(np.array([1, 0]), np.array([0, 0]), np.array([3, 1]), np.array([4, 5, 6, 7], np.int32))
    assert tables.apply(first, 2, 0).tolist() == [[4, 5, 6], [7, 0, 0]]
    # row 1 keeps its first block, gains one; row 0 unchanged; row 3 new
    grown = BlockTableChanges(np.array([1, 0, 3]), np.array([1, 1, 0]), np.array([1, 0, 2]),
                              np.array([8, 9, 10], np.int32))
    assert tables.apply(grown, 3, 1).tolist() == [[4, 8], [7, 0], [9, 10]]
    batch = replace(_batch(), block_tables=None)
    with pytest.raises(ValueError, match="no block_tables"):
        batch.check(12, 16, 50, True, True)
    for change, why in [(dict(keep=np.array([3, 1])), "does not hold"), (dict(rows=np.array([1, 1])), "distinct"),
                        (dict(rows=np.array([1, -1])), "distinct"), (dict(num_new=np.array([0, 1])), "counts"),
                        (dict(rows=np.array([1])), "one entry"), (dict(new_ids=np.array([1.5])), "integer")]:
        with pytest.raises(ValueError, match=why):
            tables.apply(replace(BlockTableChanges(np.array([1, 0]), np.array([2, 1]), np.array([0, 0]),
                                                   np.zeros(0, np.int32)), **change), 2, 2)


def test_stage_batch_check_refuses_steps_it_cannot_run():
    decodes = StageBatch(3, np.array([7, 8]), np.array([20, 5]), np.array([20, 16 + 5]), np.array([1, 1]),
                         np.array([21, 6]), np.array([[0, 1], [2, 3]], dtype=np.int32), np.array([0, 1]),
                         ["a", "b"], num_steps=12)
    decodes.check(12, 16, 50, True, True)  # 21 + 11 tokens fit in two blocks of 16
    for change, why in [(dict(num_steps=13), "do not cover"), (dict(num_steps=0), "num_steps"),
                        (dict(num_steps=2000), "num_steps"), (dict(logits_indices=np.array([1, 0])), "num_steps")]:
        with pytest.raises(ValueError, match=why):
            replace(decodes, **change).check(12, 16, 50, True, True)
    decodes.check(12, 16, 50, True, False)  # each stage of a pipeline runs the steps
    decodes.check(12, 16, 50, False, True)
    with pytest.raises(ValueError, match="num_steps"):
        replace(_batch(), num_steps=2).check(12, 16, 50, True, True)  # its first sequence is a prefill


def test_stage_batch_check_refuses_ahead_tokens_it_cannot_fill():
    ahead = _batch()
    ahead.input_ids[-1], ahead.ahead_req_ids = AHEAD_TOKEN, ["req-2"]
    ahead = wire.decode(wire.encode(ahead))
    ahead.check(12, 16, 50, True, True)
    assert ahead.ahead_req_ids == ["req-2"]
    for change, is_last in [(dict(), False),  # a first stage that does not sample has no token to fill in
                            (dict(ahead_req_ids=[]), True), (dict(ahead_req_ids=["req-1", "req-2"]), True)]:
        with pytest.raises(ValueError, match="ahead_req_ids"):
            replace(ahead, **change).check(12, 16, 50, True, is_last)
    ahead.input_ids[-1] = AHEAD_TOKEN - 1
    with pytest.raises(ValueError, match="input_ids"):
        ahead.check(12, 16, 50, True, True)


FRAMES = [wire.seal(KEY, CTX, wire.encode(m)) for m in MESSAGES]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=4096))
def test_random_frames_only_raise_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.unseal(KEY, CTX, data, "x")


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(frame=st.sampled_from(FRAMES), cut=st.integers(0, 10 ** 6), flips=st.lists(st.tuples(st.integers(0, 10 ** 6),
       st.integers(1, 255)), max_size=4), extra=st.binary(max_size=64))
def test_truncated_damaged_and_padded_payloads_only_raise_wire_error(frame, cut, flips, extra):
    """Signed with the right key, so the decoder itself meets the damage (as from a peer that has the token)."""
    payload = bytearray(frame[:-wire.TAG_BYTES])
    payload = payload[:cut % (len(payload) + 1)]
    for at, bits in flips:
        if payload:
            payload[at % len(payload)] ^= bits
    payload += extra
    try:
        msg = wire.decode(wire.unseal(KEY, CTX, wire.seal(KEY, CTX, bytes(payload)), "x"))
    except wire.WireError:
        return
    assert type(msg).__name__ in wire.KINDS  # a damage that still decodes gives a well-typed message


def test_tokens():
    assert len(wire.new_token()) == 64 and wire.new_token() != wire.new_token()
    with pytest.raises(ValueError, match="at least 16"):
        wire.check_token("short", "PIPELLM_TOKEN")
