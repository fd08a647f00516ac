"""The `pipellm` command, run as a user would."""
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "pipellm.entrypoints.cli"]


def _run(args, **kw):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=120, **kw)


def test_generate_prints_stages_text_and_speed(llama_dir):
    out = _run(["generate", "--model", llama_dir, "-pp", "2", "--max-tokens", "5", "Hello world"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("stage 0: embed + layers 0-2, ") and "MB weights (F32)" in lines[0]
    assert lines[1].startswith("stage 1: layers 3-4 + norm + lm_head, ") and lines[1].endswith(" MB resident")
    assert "'Hello world' ->" in out.stdout
    assert "tokens/s" in lines[-1]


def test_chat_reads_turns_until_eof(llama_dir):
    out = _run(["chat", "--model", llama_dir, "--max-tokens", "4"], input="Hello\nHow are you?\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") == 3  # two turns answered, then the prompt that met EOF


def test_bad_arguments_exit_with_a_message(llama_dir):
    out = _run(["generate", "--model", llama_dir, "--layer-partition", "2,2", "-pp", "2", "hi"])
    assert out.returncode == 2 and "sums to 4, but the model has 5 layers" in out.stderr
    out = _run(["generate", "--model", os.path.join(llama_dir, "missing"), "hi"])
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_bad_multihost_arguments_exit_with_a_message(llama_dir):
    out = _run(["generate", "--model", llama_dir, "-pp", "2", "--nnodes", "2", "--node-rank", "1", "hi"])
    assert out.returncode == 2 and "on the other hosts run `pipellm stage --nnodes 2 --node-rank 1" in out.stderr
    out = _run(["generate", "--model", llama_dir, "-pp", "2", "--nnodes", "3", "hi"])
    assert out.returncode == 2 and "nnodes=3: must be an integer from 1 to pipeline_parallel_size=2" in out.stderr
    out = _run(["stage"])
    assert out.returncode == 2 and "give --nnodes (hosts in all, >= 2) and --node-rank" in out.stderr
    out = _run(["stage", "--nnodes", "2", "--node-rank", "0"])
    assert out.returncode == 2 and "node 0 is the driver's host" in out.stderr
    out = _run(["stage", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--connect-timeout", "1"])
    assert out.returncode == 2 and "no token: give the driver's token file with --token-file" in out.stderr
    out = _run(["stage", "--nnodes", "2", "--node-rank", "1", "--token-file", "/nonexistent/token"])
    assert out.returncode == 2 and "--token-file /nonexistent/token: cannot read it" in out.stderr
    out = _run(["stage", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--connect-timeout", "1"],
               env=os.environ | {"PIPELLM_TOKEN": "short"})
    assert out.returncode == 2 and "PIPELLM_TOKEN: the token has 5 characters; use at least 16" in out.stderr
    out = _run(["stage", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--connect-timeout", "1"],
               env=os.environ | {"PIPELLM_TOKEN": TOKEN})
    assert out.returncode == 2 and "no driver answered at 127.0.0.1:1 within 1 s" in out.stderr


TOKEN = "0123456789abcdef0123456789abcdef"


def test_stage_agent_refuses_a_different_nnodes(llama_dir):
    from pipellm.pipeline import comm
    store = comm.SignedStore(comm.make_store("127.0.0.1", 0, is_master=True), TOKEN.encode())
    store.set(comm.NNODES_KEY, "3")
    out = _run(["stage", "--nnodes", "2", "--node-rank", "1", "--master-port", str(store.store.port)],
               env=os.environ | {"PIPELLM_TOKEN": TOKEN})
    assert out.returncode == 2 and "--nnodes 2, but the driver at 127.0.0.1" in out.stderr
    assert "runs with --nnodes 3" in out.stderr
