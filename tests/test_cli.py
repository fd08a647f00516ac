"""The `pipellm` command, run as a user would: a few real runs in a process of their own, the parsing and every
mistake in this process (the same main(), without paying for a Python start each)."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pipellm.config import generation_defaults
from pipellm.entrypoints.cli import (_chat_template, _engine_kwargs, _fitting_prompt, _reply, _sampling_params, main,
                                     parse_args)
from pipellm.llm import LLM
from pipellm.sampling_params import BeamSearchParams

CLI = [sys.executable, "-m", "pipellm.entrypoints.cli"]
TOKEN = "0123456789abcdef0123456789abcdef"


def _run(args, **kw):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=120, **kw)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def _fails(capsys, *argv) -> str:
    """main(argv) ends with exit status 2 and one line on stderr, which it returns."""
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return _error_line(err)


def _model_copy(llama_dir: str, folder, config: dict | None = None, generation: dict | None = None) -> str:
    """A copy of the tiny Llama checkpoint with config.json and generation_config.json entries changed."""
    shutil.copytree(llama_dir, folder)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        path = os.path.join(folder, name)
        with open(path) as f:
            d = json.load(f)
        d.update(changes or {})
        with open(path, "w") as f:
            json.dump({k: v for k, v in d.items() if v is not None}, f)
    return str(folder)


@pytest.fixture(scope="module")
def three_token_model(llama_dir, tmp_path_factory):
    """Greedy, 3 new tokens at most, as its generation_config.json says."""
    folder = tmp_path_factory.mktemp("gen") / "model"
    return _model_copy(llama_dir, folder, generation={"temperature": 0.0, "max_new_tokens": 3})


def test_generate_and_chat(three_token_model, tmp_path):
    """The model positionally, prompts before and after options, the model's generation config, and a chat template
    file that turns any chat into generate's prompt, so the reply is generate's completion."""
    out = _run(["generate", three_token_model, "Hello world", "-pp", "2", "--prompt", "Once upon a time"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # dtype "auto": F32, or BF16 on a CPU whose bf16 matmul is faster
    assert lines[0].startswith("stage 0: embed + layers 0-2, ")
    assert re.search(r" \d+ MB weights \((F32|BF16)\)", lines[0])
    assert lines[1].startswith("stage 1: layers 3-4 + norm + lm_head, ") and lines[1].endswith(" MB resident")
    assert "'Once upon a time' ->" in out.stdout
    assert lines[-1].startswith("6 tokens in ") and "tokens/s" in lines[-1]  # max_new_tokens 3, for 2 prompts
    completion = out.stdout.split("'Hello world' ->\nHello world", 1)[1].split("\n\n'Once upon a time' ->")[0]
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{% endfor %}Hello world")
    out = _run(["chat", three_token_model, "--chat-template", str(template)], input="hi\n\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith(f"> {completion}\n> ")  # one turn, then the empty line quits


def test_generate_beam_search(three_token_model, llm_pp2):
    out = _run(["generate", three_token_model, "Hello world", "--beam-width", "3", "--length-penalty", "0.5",
                "--dtype", "float32"])
    assert out.returncode == 0, out.stderr
    [want] = llm_pp2.beam_search(["Hello world"], BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=0.5))
    beams = out.stdout.split("'Hello world' ->\n", 1)[1].splitlines()
    assert beams == [f"[beam {i}: cum_logprob {s.cum_logprob:.3f}, {s.finish_reason}] {s.text}"
                     for i, s in enumerate(want.sequences)]


def test_generation_config_under_the_flags(llama_dir, tmp_path):
    model = _model_copy(llama_dir, tmp_path / "model", generation={"temperature": 0.7, "top_k": 5,
                                                                    "max_new_tokens": 3, "do_sample": True})
    assert generation_defaults(model) == {"temperature": 0.7, "top_k": 5, "max_tokens": 3}
    assert generation_defaults(str(tmp_path)) == {}
    fake_llm = SimpleNamespace(engine=SimpleNamespace(model_dir=model))
    assert LLM.get_default_sampling_params(fake_llm).max_tokens == 3

    def params(*flags):
        args = parse_args(["generate", model, "hi", *flags])
        args.model_dir = model  # main() sets it from the model it checked
        p = _sampling_params(args)
        return p.temperature, p.top_k, p.top_p, p.max_tokens

    assert params() == (0.7, 5, 1.0, 3)
    assert params("--max-tokens", "8", "--top-p", "0.5") == (0.7, 5, 0.5, 8)
    assert params("--generation-config", "vllm") == (0.0, -1, 1.0, 64)  # the CLI's own: greedy, 64 tokens
    assert params("--generation-config", llama_dir) == (0.0, -1, 1.0, 64)  # a file without sampling settings


def test_structured_output_flags(llama_dir, tmp_path):
    def spec(*flags):
        args = parse_args(["generate", llama_dir, "hi", *flags])
        args.model_dir = llama_dir
        return _sampling_params(args).structured_outputs

    (tmp_path / "s.json").write_text('{"type": "integer"}')
    (tmp_path / "g.gbnf").write_text('root ::= "a"')
    assert spec() is None
    assert spec("--json-schema", str(tmp_path / "s.json")).json == '{"type": "integer"}'
    assert spec("--json-schema", '{"type": "string"}').json == '{"type": "string"}'
    assert spec("--grammar", str(tmp_path / "g.gbnf")).grammar == 'root ::= "a"'
    assert spec("--regex", "[0-9]+").regex == "[0-9]+"


def test_ctrl_c_stops_a_chat_reply_and_the_chat_goes_on(capsys):
    closed = []

    def pieces(interrupts: int):
        try:
            yield "a"
            for _ in range(interrupts):  # Ctrl-C while the next piece is made
                os.kill(os.getpid(), signal.SIGINT)
            yield "b"
            yield "c"
        finally:
            closed.append(interrupts)

    assert _reply(pieces(1)) == "ab" and closed == [1]  # the piece that came, then the stream closed
    assert capsys.readouterr().out == "ab [stopped]\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # a second one interrupts as usual
        _reply(pieces(2))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _reply(pieces(0)) == "abc"


def test_a_chat_longer_than_max_model_len_loses_its_oldest_turns(llm_pp2, capsys):
    limit = llm_pp2.engine.max_model_len
    turns = [{"role": r, "content": f"turn {i}: " + "Hello world! How are you today? " * 4}
             for i, r in enumerate(["user", "assistant"] * 5)]
    messages = [{"role": "system", "content": "Be brief."}] + turns + [{"role": "user", "content": "Last one."}]
    assert len(llm_pp2.chat_prompt(messages)["prompt_token_ids"]) > limit  # the test needs a long conversation
    prompt = _fitting_prompt(llm_pp2, messages, None)
    assert len(prompt["prompt_token_ids"]) < limit and prompt == llm_pp2.chat_prompt(messages)
    assert messages[0]["content"] == "Be brief." and messages[1]["role"] == "user"
    assert messages[-1]["content"] == "Last one." and len(messages) < len(turns) + 2
    assert f"outgrew max_model_len={limit}" in capsys.readouterr().out
    too_long = messages + [{"role": "user", "content": "x " * limit}]
    kept = list(too_long)
    assert _fitting_prompt(llm_pp2, too_long, None) is None and too_long == kept  # nothing dropped for nothing


def test_chat_template_is_a_file_or_the_template(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert _chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    assert _chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert _chat_template(None) is None


def test_engine_flags_reach_the_engine(llama_dir):
    kwargs = _engine_kwargs(parse_args(["serve", llama_dir, "--block-size", "32", "--no-enable-prefix-caching",
                                        "--kv-cache-memory-bytes", "512Mi", "--max-num-seqs", "4",
                                        "--kv-cache-dtype", "int8", "--speculative-config",
                                        '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert kwargs["block_size"] == 32 and kwargs["enable_prefix_caching"] is False
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert kwargs["kv_cache_dtype"] == "int8"
    assert kwargs["kv_cache_gib"] == 0.5 and kwargs["max_num_seqs"] == 4
    kwargs = _engine_kwargs(parse_args(["chat", "--enable-prefix-caching", "--kv-cache-gib", "2"]))
    assert kwargs["enable_prefix_caching"] is True and kwargs["kv_cache_gib"] == 2
    assert "block_size" not in _engine_kwargs(parse_args(["bench"]))  # unset flags leave the engine's defaults
    args = parse_args(["serve", llama_dir, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "64",
                       "--lora-modules", "sql=/adapters/sql", "chat=./chat"])
    kwargs = _engine_kwargs(args)
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 3, 64)
    assert args.lora_modules == [("sql", "/adapters/sql"), ("chat", "./chat")]


def test_model_and_prompts_on_the_command_line(llama_dir):
    args = parse_args(["generate", "-pp", "2", "--max-tokens", "32", "The capital of France is"])  # make demo
    assert args.model is None and args.prompts == ["The capital of France is"] and args.pipeline_parallel_size == 2
    args = parse_args(["generate", llama_dir, "a", "-pp", "2", "b", "--prompt", "c"])
    assert args.model == llama_dir and args.prompts == ["a", "b", "c"]
    args = parse_args(["generate", "--model", llama_dir, llama_dir, "b"])  # with --model, every word is a prompt
    assert args.model == llama_dir and args.prompts == [llama_dir, "b"]
    args = parse_args(["generate", "SmolLM2-135M-Instruct", "a", "b"])  # a known name
    assert args.model == "SmolLM2-135M-Instruct" and args.prompts == ["a", "b"]
    args = parse_args(["generate", "no-such-model", "--prompt", "a"])  # with --prompt, the word is the model
    assert args.model == "no-such-model" and args.prompts == ["a"]
    assert parse_args(["chat", llama_dir]).model == llama_dir
    assert parse_args(["serve", "--model", llama_dir]).model == llama_dir


@pytest.fixture(scope="module")
def broken_models(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    os.mkdir(root / "empty")
    _model_copy(llama_dir, root / "arch", config={"architectures": ["FooForCausalLM"]})
    _model_copy(llama_dir, root / "nokey", config={"hidden_size": None})
    _model_copy(llama_dir, root / "heads", config={"num_key_value_heads": 3})
    shutil.copytree(llama_dir, root / "badgen")
    (root / "badgen" / "generation_config.json").write_text("{not json")
    return root


@pytest.mark.parametrize("argv, message", [
    (["generate", "{root}/missing", "--prompt", "hi"], "{root}/missing' does not exist"),
    (["chat", "{root}/empty"], "{root}/empty/config.json: no config.json"),
    (["generate", "{root}/arch", "hi"], "architecture ['FooForCausalLM'] is not supported"),
    (["generate", "{root}/nokey", "hi"], "config.json lacks a field or has one of the wrong type (KeyError: "
                                         "'hidden_size')"),
    (["generate", "{root}/badgen", "hi"], "generation_config.json: not valid JSON"),
    (["generate", "{llama}", "hi", "--max-num-seqs", "0"], "--max-num-seqs 0: must be a positive integer"),
    (["generate", "{llama}", "hi", "-pp", "0"], "--pipeline-parallel-size 0: must be an integer >= 1"),
    (["generate", "{llama}", "hi", "--block-size", "0"], "--block-size 0: must be a positive integer"),
    (["generate", "{llama}", "hi", "--max-num-seqs", "x"], "argument --max-num-seqs: invalid int value: 'x'"),
    (["generate", "{llama}", "hi", "--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["generate", "{llama}", "hi", "--max-tokenz", "3"], "unrecognized arguments: --max-tokenz"),
    (["generate", "./my-modle", "hi"], "model './my-modle' does not exist"),  # not a prompt for the default model
    (["generate", "{root}/heads", "hi"], "num_attention_heads=4 is not a multiple of its num_key_value_heads=3"),
    (["serve", "{llama}", "-tp", "2"], "--tensor-parallel-size 2: pipellm splits a model by layers, into pipeline "
                                       "stages: give pipeline_parallel_size (-pp) instead"),
    (["generate", "{llama}", "hi", "--tokenizer", "{root}"], "--tokenizer '{root}': pipellm reads the tokenizer from "
                                                              "the model's folder"),
    (["bench", "--model", "{llama}", "--no-enable-chunked-prefill"], "pipellm always runs a prompt in chunks"),
    (["generate", "{llama}", "hi", "--grammar", "{root}/missing.gbnf"],
     "--grammar {root}/missing.gbnf: cannot read it (No such file or directory); give a file or the text itself"),
    (["generate", "{llama}", "hi", "--regex", "a(b"], "structured_outputs.regex: at 1(8): invalid regex"),
    (["generate", "{llama}", "hi", "--regex", "a", "--json-schema", "{{}}"], "not allowed with argument --regex"),
    (["generate", "{llama}"], "no prompt: give prompts after the model, or with --prompt TEXT"),
    (["generate", "{llama}", "hi", "--beam-width", "2", "--top-p", "0.5"],
     "--top-p does not apply to a beam search (--beam-width), which ranks beams by log-probability"),
    (["generate", "{llama}", "hi", "--length-penalty", "2"], "--length-penalty ranks beams: give --beam-width"),
    (["generate", "{llama}", "hi", "--beam-width", "0"], "--beam-width 0: must be an integer >= 1"),
    (["chat", "{llama}", "--model", "{root}/arch"], "two models given"),
    (["chat", "{llama}", "--chat-template", "{root}/missing.jinja"], "--chat-template {root}/missing.jinja: "
                                                                      "cannot read it"),
    (["chat", "{llama}", "--generation-config", "{root}"], "--generation-config {root}: no generation_config.json"),
    (["serve", "{llama}", "--kv-cache-gib", "1", "--kv-cache-memory-bytes", "1Gi"], "not allowed with"),
    (["generate", "{llama}", "hi", "--kv-cache-memory-bytes", "1"], "--kv-cache-memory-bytes 1 holds 0 tokens"),
    (["serve", "{llama}", "--port", "65536"], "give a port number from 0 to 65535"),
    (["serve", "{llama}", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["serve", "{llama}", "--api-key", ""], "--api-key is empty; give the key, or leave the flag out"),  # not open
    (["bench", "--model", "{llama}", "--num-prompts", "0"], "--num-prompts '0': give an integer >= 1"),
    (["bench", "--model", "{llama}", "--json", "{root}/missing/out.json"], "its folder does not exist"),
    (["trace", "{root}/badgen/generation_config.json"], "not a trace written by pipellm (not JSON"),
    (["chat", "{llama}", "--json-schema", '{{"type": "objekt"}}'], "structured_outputs.json: Invalid type"),
    (["serve", "{llama}", "--port", "0", "--chat-template", "{{% for %}}"],  # refused at the start, not per request
     "--chat-template: the chat template rejected these messages"),
    (["serve", "{llama}", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype: invalid choice: 'fp8' (choose from"),
    (["serve", "{llama}", "--speculative-config", "ngram"], "--speculative-config: 'ngram': not JSON (Expecting "
                                                             "value); give an object, e.g."),
    (["generate", "{llama}", "hi", "--speculative-config", '{{"num_speculative_tokens": 99}}'],
     "speculative_config num_speculative_tokens=99: must be an integer from 1 to 64"),
    (["generate", "--model", "{llama}", "--layer-partition", "2,2", "-pp", "2", "hi"],
     "sums to 4, but the model has 5 layers"),
    (["generate", "--model", "{llama}", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "hi"],
     "on the other hosts run `pipellm stage --nnodes 2 --node-rank 1"),
    (["generate", "--model", "{llama}", "-pp", "2", "--nnodes", "3", "hi"],
     "--nnodes 3: must be an integer from 1 to pipeline_parallel_size=2"),
])
def test_mistakes_exit_2_with_one_line(capsys, llama_dir, broken_models, argv, message):
    def fill(text):
        return text.format(root=broken_models, llama=llama_dir)
    assert fill(message) in _fails(capsys, *map(fill, argv))


def test_vllm_flags_that_ask_for_what_pipellm_does_pass(llama_dir):
    from pipellm.entrypoints.cli import _engine_kwargs
    plain = ["serve", llama_dir, "-pp", "2"]
    assert _engine_kwargs(parse_args(plain + ["-tp", "1", "--trust-remote-code", "--enable-chunked-prefill"])) == \
        _engine_kwargs(parse_args(plain))


def test_serve_refuses_a_port_in_use(capsys, llama_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _fails(capsys, "serve", llama_dir, "--port", str(port))
        assert line == f"error: port {port} on 127.0.0.1 is in use; give another --port"


def test_serve_refuses_a_negative_responses_store_size(capsys, llama_dir):
    assert _fails(capsys, "serve", llama_dir, "--port", "0", "--responses-store-size", "-1") == \
        "error: --responses-store-size -1: give 0 (keep none) or more"


def test_serve_refuses_lora_modules_it_cannot_serve(capsys, llama_dir, tmp_path):
    assert _fails(capsys, "serve", llama_dir, "--lora-modules", "sql") == \
        "error: argument --lora-modules: --lora-modules 'sql': give NAME=PATH, e.g. sql-lora=/adapters/sql " \
        "(see `pipellm serve --help`)"
    line = _fails(capsys, "serve", llama_dir, "--port", "0", "--lora-modules", f"sql={tmp_path}")
    assert line.startswith(f"error: --lora-modules sql={tmp_path}: lora_request: this engine takes no LoRA adapters; "
                           "start it with --enable-lora"), line
    line = _fails(capsys, "serve", llama_dir, "--port", "0", "--enable-lora", "--lora-modules", f"sql={tmp_path}")
    assert line.startswith(f"error: --lora-modules sql={tmp_path}: {tmp_path}: cannot read adapter_config.json"), line
    assert _fails(capsys, "serve", llama_dir, "--port", "0", "--allow-runtime-lora-updating") == \
        "error: --allow-runtime-lora-updating loads adapters into the engine's LoRA slots: give --enable-lora too " \
        "(and --max-loras, --max-lora-rank as the adapters need)"


def test_serve_holds_its_port_while_the_engine_starts():
    """The port is bound before the stages start, so none of the sockets they open can take it meanwhile (a
    server that checked the port and bound it later lost it so once)."""
    from pipellm.entrypoints.cli import _bind
    with _bind("127.0.0.1", 0) as held, socket.socket() as other:
        with pytest.raises(OSError):
            other.bind(held.getsockname())


def test_a_mistake_in_a_process_of_its_own(broken_models):
    """Exit status 2 and one line, with no traceback, from a real start (nothing else writes to stderr)."""
    out = _run(["generate", str(broken_models / "arch"), "--prompt", "hi"])
    assert out.returncode == 2 and "architecture ['FooForCausalLM'] is not supported" in _error_line(out.stderr)


def test_bad_stage_arguments(capsys, monkeypatch):
    monkeypatch.delenv("PIPELLM_TOKEN", raising=False)
    assert "give --nnodes (hosts in all, >= 2) and --node-rank" in _fails(capsys, "stage")
    assert "node 0 is the driver's host" in _fails(capsys, "stage", "--nnodes", "2", "--node-rank", "0")
    stage = ["stage", "--nnodes", "2", "--node-rank", "1", "--master-port", "1", "--connect-timeout", "1"]
    assert "no token: give the driver's token file with --token-file" in _fails(capsys, *stage)
    assert "--token-file /nonexistent/token: cannot read it" in _fails(capsys, *stage[:5], "--token-file",
                                                                       "/nonexistent/token")
    monkeypatch.setenv("PIPELLM_TOKEN", "short")
    assert "PIPELLM_TOKEN: the token has 5 characters; use at least 16" in _fails(capsys, *stage)
    monkeypatch.setenv("PIPELLM_TOKEN", TOKEN)
    assert "no driver answered at 127.0.0.1:1 within 1 s" in _fails(capsys, *stage)


def test_stage_agent_refuses_a_different_nnodes(capsys, monkeypatch):
    from pipellm.pipeline import comm
    store = comm.SignedStore(comm.make_store("127.0.0.1", 0, is_master=True), TOKEN.encode())
    store.set(comm.NNODES_KEY, "3")
    monkeypatch.setenv("PIPELLM_TOKEN", TOKEN)
    line = _fails(capsys, "stage", "--nnodes", "2", "--node-rank", "1", "--master-port", str(store.store.port))
    assert "--nnodes 2, but the driver at 127.0.0.1" in line and "runs with --nnodes 3" in line
