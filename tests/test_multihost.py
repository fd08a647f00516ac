"""Two hosts on one machine: network namespaces joined by a veth pair. The driver and stage 0 run in one, stage 1
(started by `pipellm stage`) in the other, so activations and the rendezvous cross a real network link."""
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from pipellm import SamplingParams
from tests.conftest import FP32
from tests.serving import is_running, wait_until

HOST_A, HOST_B = "10.77.0.1", "10.77.0.2"
PROMPTS = [[i % 300 + 1, 5, (7 * i) % 250 + 3] * (1 + i % 6) for i in range(12)]
MAX_TOKENS = 24


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces, (name_a, name_b), with HOST_A and HOST_B on a veth pair; deleted afterwards."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed: cannot make network namespaces")
    tag = uuid.uuid4().hex[:6]
    a, b = f"plA{tag}", f"plB{tag}"
    try:
        _ip("netns", "add", a)
    except (subprocess.CalledProcessError, PermissionError) as e:
        pytest.skip(f"cannot make network namespaces here (needs root / CAP_SYS_ADMIN): {e}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, addr in ((a, f"va{tag}", HOST_A), (b, f"vb{tag}", HOST_B)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


TOKEN = "test-token-0123456789abcdef"  # the run's shared secret, as every host is given it


def _in_ns(ns: str, *cmd: str, log) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=os.environ | {"PIPELLM_TOKEN": TOKEN})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
    proc.wait(10)


DRIVER = """
import json, os, signal, sys, threading, time
from pipellm import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], pipeline_parallel_size=2, nnodes=2, master_addr=cfg["addr"], master_port=cfg["port"],
          restart_on_failure=cfg["restart"], dtype="float32")
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
out = {"local": sorted(llm.engine.executor.procs), "status": llm.engine.executor.stage_status(),
       "reports": [[r.model_dir, r.checkpoint_tensors] for r in llm.engine.inspect()]}
from tests.serving import listening  # every socket the driver and both stages listen on (stage 1: host B's view)
out["listening"] = [a for pid in [os.getpid()] + [s["pid"] for s in out["status"]] for a, _ in listening(pid)]
if cfg["fault"]:  # signal stage 1, on the other host, once generation is under way
    def fault():
        while max([len(r.output_token_ids) for r in list(llm.engine.requests.values())] or [0]) < 4:
            time.sleep(0.002)
        out["fault_at"] = time.monotonic()
        os.kill(out["status"][1]["pid"], getattr(signal, cfg["fault"]))
    threading.Thread(target=fault, daemon=True).start()
try:
    outs = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"]], params, use_tqdm=False)
    out["tokens"] = [o.outputs[0].token_ids for o in outs]
except Exception as e:
    out["error"], out["error_at"] = str(e), time.monotonic()
out["restarts"] = llm.engine.restarts
out["new_status"] = llm.engine.executor.stage_status()
llm.shutdown()
print("RESULT " + json.dumps(out), flush=True)
"""


def _two_hosts(hosts, model_a: str, model_b: str, tmp_path, fault: str | None = None,
               restart: bool = False) -> tuple[dict, str]:
    """Runs the driver (+ stage 0) on host A and `pipellm stage` on host B; returns the driver's result and B's log."""
    ns_a, ns_b = hosts
    port = 29400 + os.getpid() % 500
    log_b, log_a = open(tmp_path / "host_b.log", "w+"), open(tmp_path / "host_a.log", "w+")
    agent = _in_ns(ns_b, sys.executable, "-m", "pipellm.entrypoints.cli", "stage", "--nnodes", "2", "--node-rank",
                   "1", "--master-addr", HOST_A, "--master-port", str(port), "--model", model_b,
                   "--connect-timeout", "60", log=log_b)
    cfg = dict(model=model_a, addr=HOST_A, port=port, fault=fault, restart=restart, prompts=PROMPTS,
               max_tokens=MAX_TOKENS)
    driver = _in_ns(ns_a, sys.executable, "-c", DRIVER, json.dumps(cfg), log=log_a)
    try:
        driver.wait(180)
        agent.wait(10)  # it ends with the driver
    finally:
        _stop(driver)
        _stop(agent)
    log_a.seek(0)
    log_b.seek(0)
    text_a, text_b = log_a.read(), log_b.read()
    assert driver.returncode == 0, f"driver failed:\n{text_a}\nhost B:\n{text_b}"
    assert agent.returncode == 0, f"`pipellm stage` exited with {agent.returncode}:\n{text_b}"
    result = json.loads(next(line for line in text_a.splitlines() if line.startswith("RESULT "))[7:])
    return result, text_b


@pytest.fixture(scope="module")
def single_host_tokens(llm_pp2):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm_pp2.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_two_hosts_give_the_single_host_tokens(hosts, llama_dir, tmp_path, single_host_tokens):
    copy_b = str(tmp_path / "host_b_model")  # host B's own copy of the checkpoint
    shutil.copytree(llama_dir, copy_b)
    result, log_b = _two_hosts(hosts, llama_dir, copy_b, tmp_path)
    assert result["tokens"] == single_host_tokens
    assert result["local"] == [0], "the driver started a stage that belongs to host B"
    stage1_pid = result["status"][1]["pid"]
    assert f"started stages [1] (pids [{stage1_pid}])" in log_b
    # Each host read only its own stage's tensors, from its own copy.
    (dir0, tensors0), (dir1, tensors1) = result["reports"]
    assert dir0 == llama_dir and dir1 == copy_b
    assert not set(tensors0) & set(tensors1)
    assert any("embed_tokens" in t for t in tensors0) and any("lm_head" in t or "norm" in t for t in tensors1)
    assert not is_running(stage1_pid)
    # The store and gloo listen on each host's own address on the link, never on every interface.
    assert set(result["listening"]) == {HOST_A, HOST_B}, result["listening"]


def test_stage_killed_on_the_other_host_is_restarted_there(hosts, llama_dir, tmp_path, single_host_tokens):
    result, log_b = _two_hosts(hosts, llama_dir, llama_dir, tmp_path, fault="SIGKILL", restart=True)
    assert result["tokens"] == single_host_tokens
    [restart] = result["restarts"]
    assert f"stage 1 (pid {result['status'][1]['pid']}" in restart["error"]
    assert restart["detected_at"] - result["fault_at"] < 5.0
    print(f"stage 1 killed on host B: noticed in {restart['detected_at'] - result['fault_at']:.2f} s, "
          f"new pipeline in {restart['start_s']:.2f} s")
    assert "pipeline 1: started stages [1]" in log_b  # host B's agent started the new stage 1
    assert result["new_status"][1]["pid"] != result["status"][1]["pid"]
    wait_until(lambda: not any(is_running(s["pid"]) for s in result["status"] + result["new_status"]), 10,
               "every stage to end")


def test_frozen_stage_on_the_other_host_is_named_within_5_s(hosts, llama_dir, tmp_path):
    """SIGSTOP: the process lives but answers nothing; only its silent heartbeat, timed by the driver, tells."""
    result, _ = _two_hosts(hosts, llama_dir, llama_dir, tmp_path, fault="SIGSTOP")
    assert f"stage 1 (pid {result['status'][1]['pid']} on " in result["error"]
    assert "stopped answering: no heartbeat for 3 s" in result["error"]
    assert result["error_at"] - result["fault_at"] < 5.0
    print(f"stage 1 frozen on host B: error after {result['error_at'] - result['fault_at']:.2f} s")
    wait_until(lambda: not is_running(result["status"][1]["pid"]), 10, "the frozen stage to be killed")


def test_torchrun_on_both_hosts(hosts, llama_dir, tmp_path, llm_pp2):
    """Plain torchrun on each host, 2 processes on A (driver = RANK 0, stage 0) and 1 on B (stage 1)."""
    ns_a, ns_b = hosts
    port = 29900 + os.getpid() % 90
    prompt = "The capital of France is"
    procs = []
    for ns, node_rank, nproc in ((ns_b, 1, 1), (ns_a, 0, 2)):
        log = open(tmp_path / f"torchrun_{node_rank}.log", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", str(nproc), "--master-addr", HOST_A, "--master-port", str(port),
               "-m", "pipellm.entrypoints.cli", "generate", "--model", llama_dir, "-pp", "2", "--max-tokens", "8",
               "--dtype", FP32, "--distributed-executor-backend", "external_launcher", prompt]
        procs.append((_in_ns(ns, *cmd, log=log), log))
    deadline = time.monotonic() + 180
    try:
        for proc, _ in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # reported below with both hosts' logs
    finally:
        for proc, _ in procs:
            _stop(proc)
    logs = []
    for proc, log in procs:
        log.seek(0)
        logs.append(log.read())
    for proc, _ in procs:
        assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n" + "\n".join(logs)
    expected = llm_pp2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert f"{prompt}{expected.outputs[0].text}\n" in logs[1]


CLIENT = """
import json, sys, time, httpx
url = sys.argv[1]
deadline = time.monotonic() + 120
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.TransportError:
        pass
    assert time.monotonic() < deadline, "server not healthy in time"
    time.sleep(0.2)
health = httpx.get(url + "/health").json()
out = httpx.post(url + "/v1/completions", json={"prompt": sys.argv[2], "max_tokens": 8, "temperature": 0},
                 timeout=60).json()
print("RESULT " + json.dumps({"health": health, "text": out["choices"][0]["text"]}), flush=True)
"""


def test_serve_on_two_hosts(hosts, llama_dir, tmp_path, llm_pp2):
    """`pipellm serve --nnodes 2` on host A, `pipellm stage` on host B, a client on host A."""
    ns_a, ns_b = hosts
    port = 29300 + os.getpid() % 90
    prompt = "The capital of France is"
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("server", "agent", "client")}
    cli = [sys.executable, "-m", "pipellm.entrypoints.cli"]
    multihost = ["--nnodes", "2", "--master-addr", HOST_A, "--master-port", str(port)]
    server = _in_ns(ns_a, *cli, "serve", llama_dir, "-pp", "2", "--port", "8000", "--dtype", FP32, *multihost,
                    log=logs["server"])
    agent = _in_ns(ns_b, *cli, "stage", "--node-rank", "1", *multihost, log=logs["agent"])
    try:
        client = _in_ns(ns_a, sys.executable, "-c", CLIENT, "http://127.0.0.1:8000", prompt, log=logs["client"])
        client.wait(150)
        server.send_signal(15)
        server.wait(60)
        agent.wait(20)
    finally:
        for proc in (server, agent):
            _stop(proc)
    text = {}
    for name, log in logs.items():
        log.seek(0)
        text[name] = log.read()
    assert client.returncode == 0, f"client:\n{text['client']}\nserver:\n{text['server']}\nagent:\n{text['agent']}"
    result = json.loads(next(line for line in text["client"].splitlines() if line.startswith("RESULT "))[7:])
    expected = llm_pp2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert result["text"] == expected.outputs[0].text
    assert [s["alive"] for s in result["health"]["stages"]] == [True, True]
    assert agent.returncode == 0 and "the driver shut down" in text["agent"]
    assert not any(is_running(s["pid"]) for s in result["health"]["stages"])
