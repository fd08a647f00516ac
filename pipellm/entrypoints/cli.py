"""pipellm generate | chat | bench | trace | inspect | serve | stage"""
import os
import re
import signal
import sys
import threading
import time

from pipellm.entrypoints.args import SAMPLING_FLAGS, VLLM_ONLY_FLAGS, parse_args
from pipellm.extras import MissingExtraError, require_extra

CLI_SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}  # greedy and short, unless the model or a flag says


def _engine_kwargs(args, restart_default: bool = False) -> dict:
    kwargs = dict(pipeline_parallel_size=args.pipeline_parallel_size, layer_partition=args.layer_partition,
                  dtype=args.dtype, max_model_len=args.max_model_len, threads_per_stage=args.threads_per_stage,
                  seed=args.seed, distributed_executor_backend=args.distributed_executor_backend,
                  token_file=args.token_file, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, int8_activations=args.int8_activations)
    kv_cache_gib = args.kv_cache_gib if args.kv_cache_memory_bytes is None else args.kv_cache_memory_bytes / 2 ** 30
    optional = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                    block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                    kv_cache_gib=kv_cache_gib, num_scheduler_steps=args.num_scheduler_steps, device=args.device,
                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                    async_scheduling=args.async_scheduling,
                    speculative_config=args.speculative_config,
                    max_logprobs=args.max_logprobs, scheduling_policy=args.scheduling_policy,
                    enable_lora=args.enable_lora, max_loras=args.max_loras,
                    max_lora_rank=args.max_lora_rank)  # unset: defaults
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    from pipellm.llm import engine_options
    engine_options({k: getattr(args, k) for k in VLLM_ONLY_FLAGS if getattr(args, k) is not None})  # refuses or drops
    if args.distributed_executor_backend == "external_launcher":
        kwargs.update(master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(os.environ.get("MASTER_PORT", 0)))
        restart_default = False
    else:
        if args.node_rank != 0:
            raise ValueError(f"--node-rank {args.node_rank}: this command runs the driver on node 0; on the other "
                             f"hosts run `pipellm stage --nnodes {args.nnodes} --node-rank {args.node_rank} "
                             f"--master-addr {args.master_addr} ...`")
        port = args.master_port if args.master_port is not None else 29500 if args.nnodes > 1 else 0
        kwargs.update(nnodes=args.nnodes, master_addr=args.master_addr, master_port=port)
        restart_default = restart_default and args.nnodes == 1
    kwargs["restart_on_failure"] = restart_default if args.restart_on_failure is None else args.restart_on_failure
    return kwargs


def _check_model(model: str | None) -> str:
    """The model's folder. Fails in one line on a model that is missing, not installed or malformed, before any
    process starts (the engine reads the same files again; that is cheap)."""
    from pipellm.model_config import ModelConfig
    from pipellm.loader.model_folder import resolve_model
    try:
        folder = resolve_model(model)
        ModelConfig.from_pretrained(folder)
    except (OSError, RuntimeError) as e:  # no config.json, unreadable, a named model not installed
        raise ValueError(str(e)) from None
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{model or 'the default model'}: config.json lacks a field or has one of the wrong type "
                         f"({type(e).__name__}: {e})") from None
    return folder


def _make_llm(args):
    from pipellm import LLM
    return LLM(args.model, **_engine_kwargs(args))


def _sampling_values(args) -> dict:
    """The flags given, over the generation config's defaults, over greedy decoding of 64 tokens at most."""
    from pipellm.config import sampling_defaults
    values = CLI_SAMPLING_DEFAULTS | sampling_defaults(args.generation_config, args.model_dir)
    return values | {k: v for k in SAMPLING_FLAGS if (v := getattr(args, k)) is not None}


def _sampling_params(args):
    from pipellm import SamplingParams
    return SamplingParams(**_sampling_values(args), structured_outputs=_structured_outputs(args))


def _beam_search_params(args):
    """generate --beam-width: its max tokens and temperature as sampling's; what only sampling uses is refused."""
    from pipellm.sampling_params import BeamSearchParams
    if args.beam_width is None:
        if args.length_penalty is not None:
            raise ValueError("--length-penalty ranks beams: give --beam-width with it")
        return None
    for flag in ("top_p", "top_k", "json_schema", "grammar", "regex"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} does not apply to a beam search (--beam-width), which "
                             "ranks beams by log-probability: drop one of them")
    values = _sampling_values(args)
    return BeamSearchParams(beam_width=args.beam_width, max_tokens=values["max_tokens"],
                            temperature=values["temperature"],
                            length_penalty=1.0 if args.length_penalty is None else args.length_penalty)


def _structured_outputs(args):
    from pipellm import StructuredOutputsParams
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    for flag, kind in (("json_schema", "json"), ("grammar", "grammar")):
        if (value := getattr(args, flag)) is not None:
            text = _file_or_text(value, f"--{flag.replace('_', '-')}", "{}:=\"'", "a file or the text itself")
            return StructuredOutputsParams(**{kind: text})
    return None


def _file_or_text(value: str | None, flag: str, marks: str, what: str) -> str | None:
    """A flag that takes a file's text or the text itself (as vLLM's --chat-template): the file when it can be read,
    else the value when it holds one of marks, so a mistyped path is an error and not a grammar or template."""
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in marks):
            return value
        raise ValueError(f"{flag} {value}: cannot read it ({e.strerror or e}); give {what}") from None


def cmd_generate(args) -> None:
    beam = _beam_search_params(args)
    params = _sampling_params(args) if beam is None else None
    with _make_llm(args) as llm:
        for line in llm.describe_stages():
            print(line)
        if beam is not None:
            for prompt, out in zip(args.prompts, llm.beam_search(args.prompts, beam, use_tqdm=False)):
                print(f"\n{prompt!r} ->")
                for rank, seq in enumerate(out.sequences):
                    print(f"[beam {rank}: cum_logprob {seq.cum_logprob:.3f}, {seq.finish_reason}] {seq.text}")
            return
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        for out in outputs:
            print(f"\n{out.prompt!r} ->\n{out.prompt}{out.outputs[0].text}")
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"\n{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s")


def _chat_template(value: str | None) -> str | None:
    return _file_or_text(value, "--chat-template", "{}\n", "a template file or the Jinja template itself")


def _check_chat_template(tokenizer, messages: list[dict], template: str | None) -> None:
    """Fails now, before the first turn, on a model without a template or a template that does not render."""
    from jinja2 import TemplateError
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("the model has no chat template; give one with --chat-template FILE")
    try:
        tokenizer.apply_chat_template(messages + [{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True, chat_template=template)
    except TemplateError as e:
        raise ValueError(f"the chat template does not render ({type(e).__name__}: {e})") from None


def cmd_chat(args) -> None:
    params = _sampling_params(args)
    template = _chat_template(args.chat_template)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with _make_llm(args) as llm:
        _check_chat_template(llm.get_tokenizer(), messages, template)
        llm.engine.inputs.check_structured(params)  # refused now, not after the first message
        for line in llm.describe_stages():
            print(line)
        print("Type a message; an empty line or Ctrl-D quits, Ctrl-C stops a reply.")
        while True:
            try:
                user = input("> ")
            except EOFError:
                break
            if not user.strip():
                break
            messages.append({"role": "user", "content": user})
            prompt = _fitting_prompt(llm, messages, template)
            if prompt is None:
                print(f"(this message alone is longer than max_model_len={llm.engine.max_model_len} tokens: shorten "
                      "it)")
                messages.pop()
                continue
            reply = _reply(llm.stream(prompt, params))
            messages.append({"role": "assistant", "content": reply})


def _fitting_prompt(llm, messages: list[dict], template: str | None) -> dict | None:
    """The conversation's prompt, with as many of its oldest turns left out (from the list too) as it takes to leave
    room for a reply; None, the list unchanged, when its last message alone does not fit."""
    first = 1 if messages[0]["role"] == "system" else 0
    for start in range(first, len(messages)):
        if messages[start]["role"] != "user":  # a kept conversation starts with a user's turn, as templates expect
            continue
        prompt = llm.chat_prompt(messages[:first] + messages[start:], chat_template=template)
        if len(prompt["prompt_token_ids"]) < llm.engine.max_model_len:
            if start > first:
                print(f"(the conversation outgrew max_model_len={llm.engine.max_model_len} tokens: its oldest "
                      f"{start - first} message(s) left it)")
                del messages[first:start]
            return prompt
    return None


def _reply(stream) -> str:
    """Prints a reply as it comes. Ctrl-C stops it (closing the stream aborts its request) and the chat goes on; a
    second Ctrl-C before the next piece interrupts as usual. The stages ignore SIGINT: the driver handles it."""
    stop = threading.Event()

    def on_sigint(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    reply, previous = "", signal.signal(signal.SIGINT, on_sigint)
    try:
        for piece in stream:
            print(piece, end="", flush=True)
            reply += piece
            if stop.is_set():
                stream.close()
                print(" [stopped]", end="")
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    print()
    return reply


def cmd_bench(args) -> None:
    import json

    from pipellm.entrypoints.bench import format_result, run_bench
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json {args.json}: its folder does not exist; give a path in an existing folder")
    result = run_bench(args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len, compare_hf=args.compare_hf, trace_dir=args.trace_dir,
                       roofline=args.roofline,
                       **_engine_kwargs(args))
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def cmd_trace(args) -> None:
    from pipellm.observe.trace import load_trace, render_pipeline_png, summarize
    data = load_trace(args.trace_json)
    png = args.png or os.path.join(os.path.dirname(args.trace_json), "pipeline.png")
    render_pipeline_png(data, png)
    summary = summarize(data)
    print(f"{png}: bubble {summary['bubble_pct']:.1f}%, balance {summary['balance']:.2f}, "
          f"{summary['tokens_per_s']:.1f} generated tok/s")


def cmd_inspect(args) -> None:
    require_extra("plot", "pipellm inspect, which draws lens.png and kv.png,")  # before the model runs
    from pipellm.observe.inspect import save_inspect, summary
    with _make_llm(args) as llm:
        data = llm.inspect(args.prompt)
    paths = save_inspect(data, args.out)
    print(summary(data))
    print("wrote " + ", ".join(paths.values()))


def _bind(host: str, port: int):
    """The server's address, bound now: a port in use fails before the engine starts, and no socket the engine opens
    meanwhile (its stages' rendezvous and connections take free ports) can take it (vLLM binds early for the same
    reason). uvicorn listens on it once the engine is up."""
    import errno
    import socket
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind)
    except OSError as e:
        raise ValueError(f"cannot listen on {host} port {port} ({e.strerror or e}); give another --host or --port") \
            from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use; give another --port") from None
        raise ValueError(f"cannot listen on {host} port {port} ({e.strerror or e}); give another --host or --port") \
            from None
    return sock


def cmd_serve(args) -> None:
    require_extra("serve", "pipellm serve")
    from pipellm.entrypoints.server import ServerConfig, run_server
    from pipellm.loader.default_model import DEFAULT_MODEL_NAME
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or openai)")
    template = _chat_template(args.chat_template)
    sock = _bind(args.host, args.port)
    config = ServerConfig(args.served_model_name or args.model or DEFAULT_MODEL_NAME, args.host, args.port,
                          args.api_key, metrics_public=args.metrics_public, max_request_bytes=args.max_request_bytes,
                          max_request_seqs=args.max_request_seqs, max_request_tokens=args.max_request_tokens,
                          max_waiting_seqs=args.max_waiting_seqs, log_level=args.log_level, trace_dir=args.trace_dir,
                          generation_config=args.generation_config,
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          chat_template=template, reasoning_parser=args.reasoning_parser,
                          allowed_origins=tuple(args.allowed_origins), lora_modules=tuple(args.lora_modules),
                          allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                          responses_store_size=args.responses_store_size)
    run_server(args.model, _engine_kwargs(args, restart_default=True), config, sock)


def cmd_stage(args) -> None:
    from pipellm.loader.model_folder import resolve_model
    from pipellm.pipeline import wire
    from pipellm.pipeline.node import NodeAgent
    model_dir = None if args.model is None else resolve_model(args.model)
    token = wire.token_from_env_or_file(args.token_file)
    agent = NodeAgent(args.nnodes, args.node_rank, args.master_addr, args.master_port or 29500, model_dir, token,
                      args.connect_timeout)
    sys.exit(agent.run())


def _error_line(message: str, args) -> str:
    """One line; a message about a setting ('max_num_seqs=0: ...', 'SamplingParams.top_p=2.0: ...') names its flag,
    as the user gave it (--kv-cache-memory-bytes, not the GiB it became)."""
    field, eq, rest = message.partition("=")
    name = field.rpartition(".")[2]
    if eq and re.fullmatch(r"[\w.]+", field) and hasattr(args, name):
        if name == "kv_cache_gib" and getattr(args, "kv_cache_memory_bytes", None) is not None:
            name, rest = "kv_cache_memory_bytes", re.sub(r"^[^\s:]+", str(args.kv_cache_memory_bytes), rest)
        message = f"--{name.replace('_', '-')} {rest}"
    message = message.replace('device="cpu"', "--device cpu")  # the Python API's words, in the CLI's
    return "error: " + " ".join(message.split())


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "trace": cmd_trace,
            "inspect": cmd_inspect, "serve": cmd_serve, "stage": cmd_stage}


def main(argv: list[str] | None = None) -> None:
    args = None
    try:
        args = parse_args(argv)
        if getattr(args, "distributed_executor_backend", None) == "external_launcher" and \
                os.environ.get("RANK", "0") != "0":
            # Under torchrun every process runs the same command; all but RANK 0 (the driver) are stages.
            from pipellm.pipeline.stage import main as stage_main
            return stage_main(([] if args.model is None else ["--model", args.model]) +
                              ([] if args.token_file is None else ["--token-file", args.token_file]))
        if hasattr(args, "pipeline_parallel_size"):  # the commands that start an engine here
            args.model_dir = _check_model(args.model)
        COMMANDS[args.command](args)
    except (ValueError, MissingExtraError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:
        print(_error_line(str(e), args), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
