"""What each stage process holds, what crosses a stage boundary, and how stage processes end."""
import os
import signal
import threading
import time

import pytest

from pipellm import LLM, SamplingParams
from pipellm.pipeline.executor import PipelineError
from tests.conftest import NUM_LAYERS

HIDDEN = 64


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits to be reaped.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_a_stage_with_a_tied_embedding_and_head_holds_the_matrix_once(checkpoints, arch):
    folder, hf = checkpoints[arch]
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight  # tied: one parameter below
    params = list(hf.parameters())
    with LLM(folder, dtype="float32") as llm:
        held = sum(n for _, n in llm.engine.inspect()[0].weight_bytes)
    assert held == sum(p.numel() for p in params) * 4


def test_each_stage_holds_only_its_layers(llama_dir):
    with LLM(llama_dir, pipeline_parallel_size=3, layer_partition=[1, 3, 1]) as llm:
        reports = llm.engine.inspect()
    assert [r.description for r in reports] == [
        "stage 0: embed + layers 0-0", "stage 1: layers 1-3", "stage 2: layers 4-4 + norm + lm_head"]
    layer_sets = []
    for report, (start, end) in zip(reports, [(0, 1), (1, 4), (4, 5)]):
        assert report.num_kv_caches == end - start
        assert report.kv_cache_shape[1:] == (16, 2, 16)  # [num_blocks, block_size, kv_heads, head_dim]
        layer_sets.append({int(n.split(".")[1]) for n in report.param_names if n.startswith("layers.")})
        # The checkpoint tensors it read are exactly those of its own layers (plus embed / head).
        read_layers = {int(n.split(".")[2]) for n in report.checkpoint_tensors if n.startswith("model.layers.")}
        assert read_layers == set(range(start, end))
    assert layer_sets == [{0}, {0, 1, 2}, {0}]  # local indices: each stage builds a plain slice
    # the first stage only looks its embedding up: it reads rows from the file instead of holding a copy
    assert "model.embed_tokens.weight" in reports[0].checkpoint_tensors
    assert [f for f, _ in reports[0].weight_bytes if f.endswith("file-mapped")] == ["F32 file-mapped"]
    assert not any(n.startswith(("embed_tokens", "lm_head", "norm")) for n in reports[1].param_names)
    assert {"lm_head.weight_t", "norm.weight"} <= set(reports[2].param_names)
    assert "model.embed_tokens.weight" not in reports[2].checkpoint_tensors  # untied head: no embedding there
    assert len({r.pid for r in reports}) == 3 and os.getpid() not in {r.pid for r in reports}


def test_only_hidden_states_cross_a_boundary(llama_dir):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9] * 20, [3, 4]]
    new_tokens = 6
    with LLM(llama_dir, pipeline_parallel_size=3, dtype="float32") as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
        reports = llm.engine.inspect()
    # Every prompt token once, then each generated token but the last is fed back once.
    tokens = sum(len(p) for p in prompts) + len(prompts) * (new_tokens - 1)
    for report in reports[:-1]:
        assert report.activation_tokens_sent == tokens
        assert report.activation_bytes_sent == tokens * HIDDEN * 1 * 4  # tokens x hidden x fp32, no residual
    assert reports[-1].activation_bytes_sent == 0  # the last stage sends only sampled token ids


def test_threads_and_affinity(llama_dir):
    with LLM(llama_dir, pipeline_parallel_size=2, threads_per_stage=1) as llm:
        reports = llm.engine.inspect()
    assert [r.num_threads for r in reports] == [1, 1]
    cores = sorted(os.sched_getaffinity(0))
    assert [r.cpu_affinity for r in reports] == [[cores[0]], [cores[1 % len(cores)]]]


def test_no_stage_outlives_shutdown(llama_dir):
    llm = LLM(llama_dir, pipeline_parallel_size=2)
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    assert all(_alive(pid) for pid in pids)
    llm.shutdown()
    assert not any(_alive(pid) for pid in pids)
    llm.shutdown()  # twice is fine


def test_killed_stage_is_named_quickly_and_nothing_is_left(llama_dir):
    llm = LLM(llama_dir, pipeline_parallel_size=3)
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage 1 \(pid \d+\) was killed by signal 9"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 5
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
    llm.shutdown()


def _fails_mid_generation(llm: LLM, delay_s: float, action, match: str) -> None:
    """Runs a long generate, does action() delay_s into it, and expects a PipelineError matching match
    within 6 s, with every stage process gone afterwards."""
    pids = [p.pid for p in llm.engine.executor.procs.values()]
    timer = threading.Timer(delay_s, action, (pids,))
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=match):
            llm.generate([{"prompt_token_ids": [i % 300 + 1] * 8} for i in range(64)],
                         SamplingParams(max_tokens=240, ignore_eos=True), use_tqdm=False)
    finally:
        timer.cancel()
        llm.shutdown()
    assert time.monotonic() - start < 6
    assert not any(_alive(pid) for pid in pids)


def test_stage_killed_mid_generation(llama_dir):
    _fails_mid_generation(LLM(llama_dir, pipeline_parallel_size=2), 1.0,
                          lambda pids: os.kill(pids[0], signal.SIGKILL), r"stage 0 \(pid \d+\) was killed")


def test_engine_error_names_the_stage_that_failed_to_load(tmp_path, llama_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[f"model.layers.{NUM_LAYERS - 1}.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"stage 1: .*lacks tensors for layers\.\d+\.mlp\.down_proj\.weight"):
        LLM(str(broken), pipeline_parallel_size=2)


@pytest.mark.parametrize("pp", [1, 2])  # one stage: in the driver's process
def test_ctrl_c_during_generate_ends_every_stage_quickly(llama_dir, pp):
    import re
    import subprocess
    import sys

    script = (f"from pipellm import LLM, SamplingParams\n"
              f"llm = LLM({llama_dir!r}, pipeline_parallel_size={pp})\n"
              f"print('pids', [p.pid for p in llm.engine.executor.procs.values()], flush=True)\n"
              f"llm.generate([{{'prompt_token_ids': [i % 200 + 1] * 10}} for i in range(400)],\n"
              f"             SamplingParams(max_tokens=240, ignore_eos=True), use_tqdm=False)\n")
    # A terminal's Ctrl-C: SIGINT to the whole foreground process group (stages included: they ignore it).
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        pids = [int(x) for x in re.findall(r"\d+", proc.stdout.readline())]
        assert len(pids) == (0 if pp == 1 else pp)
        time.sleep(1.0)  # well inside the generate call
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert time.monotonic() - start < 5
    assert "KeyboardInterrupt" in out
    time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def test_stage_that_stops_answering_is_named(llama_dir):
    _fails_mid_generation(LLM(llama_dir, pipeline_parallel_size=2, heartbeat_timeout_s=2.0), 0.5,
                          lambda pids: os.kill(pids[1], signal.SIGSTOP),  # alive, but frozen
                          r"stage 1 \(pid \d+\) stopped answering: no heartbeat for 2 s")


def _children() -> set[int]:
    me = str(os.getpid())
    kids = set()
    for task in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{task}/children") as f:
            kids |= {int(p) for p in f.read().split()}
    return kids


def test_one_stage_runs_in_this_process_without_a_port(checkpoints):
    from pipellm.config import EngineConfig
    from tests.conftest import hf_greedy_ids

    before = _children()
    prompt = [(3 * i + 2) % 300 for i in range(21)]
    with LLM(checkpoints["llama"][0], dtype="float32") as llm:
        engine = llm.engine
        assert engine.config.distributed_executor_backend == "uni"
        assert engine.store is None  # no rendezvous store: nothing listens on a port
        assert _children() == before  # no stage process
        assert [s["pid"] for s in engine.executor.stage_status()] == [os.getpid()]
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=10, temperature=0.0,
                                                                        ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == hf_greedy_ids(checkpoints["llama"][1], [prompt], 10)[0]
        assert llm.describe_stages()[0].startswith("stage 0: embed + layers 0-")
    # where the stage must be a process of its own, or there are several: processes, as before
    assert EngineConfig("m", restart_on_failure=True).distributed_executor_backend == "mp"
    assert EngineConfig("m", async_scheduling=True).distributed_executor_backend == "mp"
    assert EngineConfig("m", pipeline_parallel_size=2).distributed_executor_backend == "mp"
    for bad, match in ((dict(pipeline_parallel_size=2), 'use "mp" for'), (dict(restart_on_failure=True),
                       "restart_on_failure"), (dict(async_scheduling=True), "async_scheduling")):
        with pytest.raises(ValueError, match=match):
            EngineConfig("m", distributed_executor_backend="uni", **bad)


def test_a_failure_of_the_stage_in_this_process_is_named_and_ends_the_llm(llama_dir):
    llm = LLM(llama_dir)
    step, calls = llm.engine.executor.worker.step, []

    def fails_on_the_third(batch):
        calls.append(batch.batch_id)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return step(batch)
    llm.engine.executor.worker.step = fails_on_the_third
    with pytest.raises(PipelineError, match=r"stage 0 \(in the driver's process\) failed while running a batch: "
                                            r"RuntimeError: injected"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8), use_tqdm=False)
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
    llm.shutdown()


@pytest.mark.parametrize("parent_alive", [True, False])
def test_a_stage_whose_driver_died_while_it_started_exits_at_once(parent_alive):
    """A driver killed in the second a stage imports torch leaves it no death signal to receive (it asks for one
    after): the stage sees that its parent is not the one that started it and exits, not waiting 300 s for a store."""
    import subprocess
    import sys

    from pipellm.pipeline import comm
    started_by = os.getpid() if parent_alive else 1  # pid 1 stands for a parent that died: it adopts orphans
    out = subprocess.run([sys.executable, "-c", "from pipellm.pipeline.stage import _die_with_parent; "
                          "_die_with_parent(); print('running')"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, comm.PARENT_PID_ENV: str(started_by)})
    assert (out.returncode, out.stdout.strip()) == ((0, "running") if parent_alive else (1, "")), out.stderr
