"""The pipeline picture: trace events, PNG charts and summary from a real run."""
import json

import matplotlib.image
import pytest

from pipellm import LLM, SamplingParams
from pipellm.entrypoints.cli import main as cli_main

PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(12 + 5 * i)]} for i in range(8)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _run(llama_dir, out_dir, **kwargs):
    with LLM(llama_dir, pipeline_parallel_size=3, trace_dir=str(out_dir), **kwargs) as llm:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return json.loads((out_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def traced(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace")
    return out, _run(llama_dir, out, dtype="float32")  # hidden states of 4 bytes a value, on any CPU


def test_trace_has_a_track_per_stage_and_batches_flow_in_stage_order(traced):
    out, _ = traced
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert [names[r] for r in range(3)] == ["stage 0: embed + layers 0-1", "stage 1: layers 2-3",
                                            "stage 2: layers 4-4 + norm + lm_head"]
    forwards = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    assert all(e["dur"] >= 0 and e["args"]["tokens"] > 0 for e in forwards)
    by_batch = {}
    for e in forwards:
        by_batch.setdefault(e["args"]["batch"], {})[e["pid"]] = e
    assert len(by_batch) > 8
    for batch, slices in by_batch.items():
        assert sorted(slices) == [0, 1, 2], f"batch {batch} missing on a stage"
        # Stage i+1 starts a batch only after stage i has finished it.
        for a, b in zip((slices[0], slices[1]), (slices[1], slices[2])):
            assert b["ts"] >= a["ts"] + a["dur"] - 1, batch
    assert any(e["ph"] == "C" and e["name"] == "KV blocks" for e in events)


def test_pictures_are_written_and_decode(traced):
    out, _ = traced
    pipeline = matplotlib.image.imread(out / "pipeline.png")
    assert pipeline.shape[:2] == (int((1.2 + 0.9 * 3) * 100), 1400)
    kv = matplotlib.image.imread(out / "kv_cache.png")
    assert kv.shape[:2] == (400, 1000)


def test_summary_figures(traced):
    _, summary = traced
    assert 0 <= summary["bubble_pct"] <= 100
    assert summary["balance"] >= 1.0
    assert [s["num_layers"] for s in summary["stages"]] == [2, 2, 1]
    assert [s["bytes_sent_per_token"] for s in summary["stages"][:2]] == [64 * 4, 64 * 4]
    assert summary["tokens_per_s"] > 0


def test_one_batch_in_flight_leaves_more_bubble(tmp_path):
    from tests.conftest import make_checkpoint

    # Wide enough that compute, not per-step messaging, fills the stages' time.
    model_dir = tmp_path / "wide"
    make_checkpoint("llama", str(model_dir), hidden_size=512, intermediate_size=1536)
    pipelined = _run(str(model_dir), tmp_path / "pipelined")
    serial = _run(str(model_dir), tmp_path / "serial", max_batches_in_flight=1)
    assert 0 <= pipelined["bubble_pct"] < serial["bubble_pct"] <= 100
    assert serial["bubble_pct"] > 50  # one batch at a time: two of three stages always wait


def test_trace_command_rerenders(traced, tmp_path, capsys):
    out, _ = traced
    png = tmp_path / "again.png"
    cli_main(["trace", str(out / "trace.json"), "--png", str(png)])
    assert matplotlib.image.imread(png).shape[1] == 1400
    assert "bubble" in capsys.readouterr().out
