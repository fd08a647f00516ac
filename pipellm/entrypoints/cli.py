"""pipellm generate | chat | bench | trace | inspect | serve | stage"""
import argparse
import os
import sys
import time


def _partition(text: str) -> list[int] | str:
    if text == "auto":
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-partition {text!r}: give layer counts per stage, e.g. 15,15")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (config.json + safetensors) or .gguf file; "
                                                 "default: SmolLM2-135M-Instruct")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, help="number of pipeline stages")
    p.add_argument("--layer-partition", "--partition", type=_partition, default=None,
                   help="layers per stage, e.g. 10,12,8, or auto (profiled on this machine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): float32 unless bf16 measures faster on this CPU")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="quantize an HF checkpoint's linear weights on load (GGUF files stay in their own formats)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads-per-stage", type=int, default=None, help="default: cores // stages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one step at most (default 64)")
    p.add_argument("--restart-on-failure", action=argparse.BooleanOptionalAction, default=None,
                   help="when a stage fails, start a new pipeline and re-run unfinished requests "
                        "(default: on for serve on one host, off otherwise)")
    _multinode_args(p)
    p.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "external_launcher"],
                   help="external_launcher: torchrun started every process (RANK 0 is the driver, 1.. the stages)")


def _multinode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=1, help="hosts the stages run on (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index; 0 runs the driver")
    p.add_argument("--master-addr", default="127.0.0.1", help="the driver host's address, reachable from the others")
    p.add_argument("--master-port", type=int, default=None, help="the driver's rendezvous port (default 29500 when "
                                                                 "--nnodes > 1, any free port otherwise)")
    p.add_argument("--token-file", default=None, help="the run's shared secret, for several hosts (or set "
                                                      "PIPELLM_TOKEN); the driver makes the file if it is missing, "
                                                      "the other hosts get a copy")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)


def _engine_kwargs(args, restart_default: bool = False) -> dict:
    kwargs = dict(layer_partition=args.layer_partition, max_model_len=args.max_model_len,
                  distributed_executor_backend=args.distributed_executor_backend, token_file=args.token_file,
                  quantization=args.quantization)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
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


def _make_llm(args):
    from pipellm import LLM
    return LLM(args.model, pipeline_parallel_size=args.pipeline_parallel_size, dtype=args.dtype,
               threads_per_stage=args.threads_per_stage, seed=args.seed, **_engine_kwargs(args))


def _params(args):
    from pipellm import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k)


def cmd_generate(args) -> None:
    params = _params(args)
    with _make_llm(args) as llm:
        for line in llm.describe_stages():
            print(line)
        start = time.perf_counter()
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        for out in outputs:
            print(f"\n{out.prompt!r} ->\n{out.prompt}{out.outputs[0].text}")
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"\n{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s")


def cmd_chat(args) -> None:
    params = _params(args)
    with _make_llm(args) as llm:
        for line in llm.describe_stages():
            print(line)
        print("Type a message; an empty line or Ctrl-D quits.")
        messages = [{"role": "system", "content": args.system}] if args.system else []
        while True:
            try:
                user = input("> ")
            except EOFError:
                break
            if not user.strip():
                break
            messages.append({"role": "user", "content": user})
            reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
            print(reply)
            messages.append({"role": "assistant", "content": reply})


def _length_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: give a length (128) or a range (64-192)")
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: need 1 <= min <= max")
    return lo, hi


def cmd_bench(args) -> None:
    import json

    from pipellm.entrypoints.bench import format_result, run_bench
    result = run_bench(args.model, args.pipeline_parallel_size, args.num_prompts, args.input_len, args.output_len,
                       args.dtype, args.threads_per_stage, args.compare_hf, args.seed, trace_dir=args.trace_dir,
                       **_engine_kwargs(args))
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def cmd_trace(args) -> None:
    import os

    from pipellm.observe.trace import load_trace, render_pipeline_png, summarize
    data = load_trace(args.trace_json)
    png = args.png or os.path.join(os.path.dirname(args.trace_json), "pipeline.png")
    render_pipeline_png(data, png)
    summary = summarize(data)
    print(f"{png}: bubble {summary['bubble_pct']:.1f}%, balance {summary['balance']:.2f}, "
          f"{summary['tokens_per_s']:.1f} generated tok/s")


def _positional_model(args) -> str | None:
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given ({args.model_path!r} and --model {args.model!r}); give one")
    return args.model_path or args.model


def cmd_inspect(args) -> None:
    from pipellm.observe.inspect import save_inspect, summary
    args.model = _positional_model(args)
    with _make_llm(args) as llm:
        data = llm.inspect(args.prompt)
    paths = save_inspect(data, args.out)
    print(summary(data))
    print("wrote " + ", ".join(paths.values()))


def cmd_serve(args) -> None:
    from pipellm.entrypoints.server import ServerConfig, run_server
    from pipellm.loader.default_model import DEFAULT_MODEL_NAME
    model = _positional_model(args)
    engine_kwargs = dict(pipeline_parallel_size=args.pipeline_parallel_size, dtype=args.dtype, seed=args.seed,
                         threads_per_stage=args.threads_per_stage, **_engine_kwargs(args, restart_default=True))
    config = ServerConfig(args.served_model_name or model or DEFAULT_MODEL_NAME, args.host, args.port, args.api_key,
                          metrics_public=args.metrics_public, max_request_bytes=args.max_request_bytes,
                          max_request_seqs=args.max_request_seqs, max_request_tokens=args.max_request_tokens,
                          max_waiting_seqs=args.max_waiting_seqs, log_level=args.log_level, trace_dir=args.trace_dir)
    run_server(model, engine_kwargs, config)


def cmd_stage(args) -> None:
    from pipellm.engine.engine import resolve_model
    from pipellm.pipeline import wire
    from pipellm.pipeline.node import NodeAgent
    model_dir = None if args.model is None else resolve_model(args.model)
    token = wire.token_from_env_or_file(args.token_file)
    agent = NodeAgent(args.nnodes, args.node_rank, args.master_addr, args.master_port or 29500, model_dir, token,
                      args.connect_timeout)
    sys.exit(agent.run())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipellm", description="Pipeline-parallel LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts")
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("prompts", nargs="+")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="chat in the terminal with the model's chat template")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)
    bench = sub.add_parser("bench", help="offline throughput on generated requests")
    _engine_args(bench)
    bench.add_argument("--num-prompts", type=int, default=32)
    bench.add_argument("--input-len", type=_length_range, default=(64, 192), help="prompt length or range, e.g. 64-192")
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate, same requests")
    bench.add_argument("--json", default=None, help="save every figure to this file")
    bench.add_argument("--trace-dir", default=None, help="write trace.json, pipeline.png, kv_cache.png, summary.json")
    bench.set_defaults(func=cmd_bench)
    trace = sub.add_parser("trace", help="re-render a saved trace.json")
    trace.add_argument("trace_json")
    trace.add_argument("--png", default=None, help="pipeline picture to write (default: beside the trace)")
    trace.set_defaults(func=cmd_trace)
    inspect = sub.add_parser("inspect", help="what each layer predicts and attends to, stage by stage: lens.png, "
                                             "kv.png, inspect.json")
    inspect.add_argument("model_path", nargs="?", default=None, metavar="model", help="same as --model")
    _engine_args(inspect)
    inspect.add_argument("--prompt", default="The capital of France is")
    inspect.add_argument("--out", default="inspect", help="folder to write the pictures and inspect.json to")
    inspect.set_defaults(func=cmd_inspect)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None, metavar="model", help="same as --model")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--max-request-seqs", type=int, default=256, help="prompts x n one request may ask for")
    serve.add_argument("--max-request-tokens", type=int, default=1 << 20,
                       help="prompt + completion tokens one request may ask for, over all its choices")
    serve.add_argument("--max-waiting-seqs", type=int, default=1024,
                       help="sequences waiting for the engine; beyond, requests get 503 with Retry-After")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--trace-dir", default=None, help="on shutdown, write the pipeline trace and pictures here")
    serve.set_defaults(func=cmd_serve)
    stage = sub.add_parser("stage", help="run this host's pipeline stages for a driver on another host")
    stage.add_argument("--model", default=None, help="this host's copy of the model (default: the driver's path)")
    _multinode_args(stage)
    stage.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the driver")
    stage.set_defaults(func=cmd_stage)
    args = parser.parse_args(argv)
    if getattr(args, "distributed_executor_backend", None) == "external_launcher" and \
            os.environ.get("RANK", "0") != "0":
        # Under torchrun every process runs the same command; all but RANK 0 (the driver) are stages.
        from pipellm.pipeline.stage import main as stage_main
        model = getattr(args, "model_path", None) or args.model
        return stage_main(([] if model is None else ["--model", model]) +
                          ([] if args.token_file is None else ["--token-file", args.token_file]))
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
