"""What an attacker who reaches pipellm's ports can and cannot do, tried against real processes as one would."""
import asyncio
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from datetime import timedelta

import httpx
import pytest
import torch.distributed as dist

from benchmarks.soak import free_port
from pipellm import LLM, SamplingParams
from pipellm.pipeline import comm
from pipellm.pipeline.executor import PipelineError
from tests.conftest import FP32
from tests.serving import is_running, listening, serve, wait_until

PROMPTS = [{"prompt_token_ids": [i % 300 + 1, 7, (3 * i) % 250 + 2] * (2 + i % 5)} for i in range(8)]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)


class _Payload:
    """Unpickling it runs a shell command that creates the canary file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _keys(generations: range, num_stages: int) -> list[str]:
    """Every key pipellm reads from the store, for these generations."""
    keys = [comm.GENERATION_KEY, comm.NNODES_KEY, comm.SHUTDOWN_KEY, comm.agent_key(1), comm.bye_key(1)]
    for g in generations:
        for r in range(num_stages):
            keys += [f"pipellm/{g}/{k}" for k in (comm.args_key(r), comm.ready_key(r), comm.error_key(r),
                                                  comm.exit_key(r), comm.heartbeat_key(r))]
        keys.append(f"pipellm/{g}/{comm.ABORT_KEY}")
    return keys


def _forgeries(canary) -> list[bytes]:
    evil = pickle.dumps(_Payload(canary))
    return [evil, evil + b"\0" * 32, b'{"pid": 1, "host": "evil"}', b"1", b"not a number", b"\x80" * 64]


def _token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def fault_free(llm_pp2):
    return _token_ids(llm_pp2.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_forged_store_values_run_no_code_and_the_pipeline_carries_on(llama_dir, tmp_path, fault_free):
    """A client on this host writes pickles and forged values under every key, for this pipeline and the next
    ones; a stage is then killed, so the restart reads its keys again. Nothing runs, and the outputs are those of
    a fault-free run."""
    canary = tmp_path / "canary"
    with LLM(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32) as llm:
        hostile = dist.TCPStore("127.0.0.1", llm.engine.store.store.port, is_master=False,
                                timeout=timedelta(seconds=10))
        for i, key in enumerate(_keys(range(4), 2)):
            forged = _forgeries(canary)
            hostile.set(key, forged[i % len(forged)])
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == fault_free  # forged reports ignored
        old = llm.engine.executor.procs[1].pid
        os.kill(old, 9)
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == fault_free
        assert len(llm.engine.restarts) == 1 and f"stage 1 (pid {old})" in llm.engine.restarts[0]["error"]
    assert not canary.exists()


def test_an_attack_that_never_stops_ends_the_pipeline_with_a_clear_error(llama_dir, tmp_path):
    """While a client keeps overwriting the stages' arguments with pickles (the attack that ran code before), a
    restarted pipeline cannot start; the engine says why and stops retrying. Still nothing runs."""
    canary = tmp_path / "canary"
    llm = LLM(llama_dir, pipeline_parallel_size=2, restart_on_failure=True, dtype=FP32)
    stop = threading.Event()

    def attack(port: int) -> None:
        hostile = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        keys, forged = [f"pipellm/{g}/{comm.args_key(r)}" for g in range(1, 5) for r in range(2)], _forgeries(canary)
        while not stop.is_set():
            for i, key in enumerate(keys):
                hostile.set(key, forged[i % len(forged)])
            time.sleep(0.001)

    attacker = threading.Thread(target=attack, args=(llm.engine.store.store.port,), daemon=True)
    try:
        attacker.start()
        os.kill(llm.engine.executor.procs[1].pid, 9)
        start = time.monotonic()
        with pytest.raises(PipelineError) as err:
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 60
        message = str(err.value)
        assert re.search(r"stage \d: WireError: a frame from the store's key pipellm/\d/args/\d is not signed with "
                         "this run's token", message), message
        assert "not restarting it again" in message
    finally:
        stop.set()
        attacker.join(10)
        llm.shutdown()
    assert not canary.exists()


def test_a_one_host_run_listens_on_loopback_only(llama_dir, tmp_path):
    with serve(llama_dir, tmp_path, "--api-key", "k") as server:
        stage_pids = server.stage_pids()
        sockets = {pid: listening(pid) for pid in [server.proc.pid, *stage_pids]}
    server_ports = {port for _, port in sockets[server.proc.pid]}
    assert int(server.url.rsplit(":", 1)[1]) in server_ports and len(server_ports) >= 2  # HTTP and the store
    for pid in stage_pids:
        assert sockets[pid], f"stage {pid} listens nowhere? gloo should"
    everything = [s for found in sockets.values() for s in found]
    assert all(addr == "127.0.0.1" for addr, _ in everything), everything


def test_a_node_agent_with_the_wrong_token_is_refused_and_the_right_one_joins(llama_dir, tmp_path, fault_free):
    port, token_file = free_port(), tmp_path / "token"
    cli = [sys.executable, "-m", "pipellm.entrypoints.cli", "stage", "--nnodes", "2", "--node-rank", "1",
           "--master-port", str(port), "--connect-timeout", "60"]
    wrong = subprocess.Popen(cli, env=os.environ | {"PIPELLM_TOKEN": "not-the-drivers-token-at-all"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    box = {}

    def driver():  # blocks until host 1's stage has joined
        try:
            box["llm"] = LLM(llama_dir, pipeline_parallel_size=2, nnodes=2, master_port=port, dtype=FP32,
                             token_file=str(token_file))
        except Exception as e:
            box["error"] = e

    thread = threading.Thread(target=driver, daemon=True)
    right = None
    try:
        thread.start()
        wait_until(token_file.exists, 60, "the driver to write its token file")
        assert token_file.stat().st_mode & 0o777 == 0o600
        out, _ = wrong.communicate(timeout=60)
        assert wrong.returncode == 2, out
        assert f"refused by the driver at 127.0.0.1:{port}: this host's token is not the driver's" in out
        right = subprocess.Popen(cli + ["--token-file", str(token_file)], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        thread.join(120)
        assert "llm" in box, box.get("error")
        llm = box["llm"]
        assert sorted(llm.engine.executor.procs) == [0]  # stage 1 runs under the right agent
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == fault_free
        llm.shutdown()
        out, _ = right.communicate(timeout=30)
        assert right.returncode == 0 and "the driver shut down" in out, out
    finally:
        for proc in (wrong, right):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if "llm" in box:
            box["llm"].shutdown()


def test_request_caps_queue_limit_and_what_the_server_shows(llama_dir, tmp_path):
    key = "sekrit"
    auth = {"Authorization": f"Bearer {key}"}
    args = ["--api-key", key, "--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "1",
            "--max-waiting-seqs", "2", "--max-request-seqs", "4", "--max-request-tokens", "300"]
    with serve(llama_dir, tmp_path, *args) as server:
        url = server.url

        def post(body):
            return httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, headers=auth, timeout=60)

        resp = post({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2})
        assert resp.status_code == 400 and "--max-request-seqs" in resp.json()["error"]["message"]
        resp = post({"prompt": ["a", "b"], "n": 2, "max_tokens": 100})
        assert resp.status_code == 400 and "--max-request-tokens" in resp.json()["error"]["message"]
        models = httpx.get(f"{url}/v1/models", headers=auth).json()
        assert models["data"][0]["root"] == "tiny" and llama_dir not in str(models)
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers=auth).status_code == 200

        async def crowd():
            """One request runs at a time (max_num_seqs 1): once two wait, the next one is turned away. Each
            request is sent once the one before it is counted, so none of the first three meets a full queue;
            each runs 240 tokens, so the queue is still full when the fourth comes."""
            async with httpx.AsyncClient(headers=auth, timeout=120) as client:
                async def gauge(name: str) -> float:
                    text = (await client.get(f"{url}/metrics")).text
                    return float(re.search(name + r"\{.*\} (\S+)", text).group(1))

                async def until(name: str, value: float):
                    deadline = time.monotonic() + 30
                    while await gauge(name) < value:
                        assert time.monotonic() < deadline, f"{name} never reached {value}"
                        await asyncio.sleep(0.005)

                body = {"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
                busy = [asyncio.create_task(client.post(f"{url}/v1/completions", json=body))]
                await until("num_requests_running", 1)
                for waiting in (1, 2):
                    busy.append(asyncio.create_task(client.post(f"{url}/v1/completions", json=body)))
                    await until("num_requests_waiting", waiting)
                resp = await client.post(f"{url}/v1/completions", json=body | {"max_tokens": 1})
                for task in busy:  # no need to wait for their tokens
                    task.cancel()
                return resp

        refused = asyncio.run(crowd())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        # room again once the crowd's requests are gone (the server aborts them as it sees their clients leave)
        deadline = time.monotonic() + 60
        while (resp := post({"prompt": "Hello", "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, "the queue never emptied after its clients left"
            time.sleep(float(resp.headers["retry-after"]) / 10)
        assert resp.status_code == 200
    with serve(llama_dir, tmp_path, "--api-key", key, "--metrics-public") as public:
        assert httpx.get(f"{public.url}/metrics").status_code == 200
        assert httpx.post(f"{public.url}/v1/completions", json={"prompt": "a"}).status_code == 401
        pids = public.stage_pids()
    assert not any(map(is_running, pids))
