"""The command line's grammar: subcommands, their flags, and generate's model-or-prompt words. cli.py runs them."""
import argparse
import json
import os
import re

from pipellm.pipeline.partition import parse_partition

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k")
VLLM_ONLY_FLAGS = ("tensor_parallel_size", "trust_remote_code", "enable_chunked_prefill", "tokenizer", "revision",
                   "tokenizer_revision", "download_dir")


_SIZE_SUFFIXES = {"k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12,
                  "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other mistake gets, rather than the whole usage
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _partition(text: str) -> list[int] | str:
    try:
        return parse_partition(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--layer-partition {text!r}: give layer counts per stage, e.g. 15,15") from e


def _num_bytes(text: str) -> int:
    """vLLM's sizes: 2147483648, 2G (10**9) or 2Gi (2**30)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text.strip())
    if not m or float(m[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size above 0 in bytes, e.g. 2147483648, 2Gi or 2G")
    return int(float(m[1]) * _SIZE_SUFFIXES.get(m[2], 1))


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give a port number from 0 to 65535")
    return int(text)


def _positive(flag: str):
    def check(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give an integer >= 1")
        return int(text)
    return check


def _non_empty(flag: str, instead: str):
    """An argument type refusing "" (an unset shell variable, `--api-key "$KEY"`, would serve with no key)."""
    def check(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{flag} is empty; {instead}")
        return text
    return check


def _lora_module(text: str) -> tuple[str, str]:
    name, eq, path = text.partition("=")
    if not eq or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: give NAME=PATH, e.g. sql-lora=/adapters/sql")
    return name.strip(), path.strip()


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: not JSON ({e.msg}); give an object, e.g. "
                                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object of the fields")
    return value


def _engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    if positional_model:
        p.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    p.add_argument("--model", default=None, help="model folder (config.json + safetensors), .gguf file or known "
                                                 "name; default: SmolLM2-135M-Instruct")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1, help="number of pipeline stages")
    p.add_argument("--layer-partition", "--partition", type=_partition, default=None,
                   help="layers per stage, e.g. 10,12,8, or auto (profiled on this machine)")
    p.add_argument("--device", default=None, help="cpu (default), cuda (a GPU a stage: the i-th stage of a host on "
                   "its i-th GPU), cuda:N (every stage of a host on GPU N), or auto (cuda where a GPU is)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU's memory the stages on it may use, weights and KV cache (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="on a GPU, launch every step op by op instead of replaying decode steps from CUDA graphs")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bf16 on a GPU (fp16 without bf16); on a CPU float32 unless bf16 measures "
                        "faster there")
    p.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"],
                   help="quantize an HF checkpoint's linear weights on load (GGUF files stay in their own formats)")
    p.add_argument("--int8-activations", action="store_true",
                   help="integer weight codes multiply activations rounded to 8 bits, as llama.cpp: faster decoding, "
                        "perplexity within 1%%; greedy output may differ where the top two tokens are close")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps the stages run per batch, the last sampling the first's next input: fewer "
                        "round trips per token, output in bursts of this many tokens (default 1)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="send the next batch while the stage runs this one (default: on with one stage, where it "
                        "applies)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='n-gram speculative decoding, as vLLM\'s: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-logprobs", type=int, default=None,
                   help="top log-probabilities a request may ask for a token at most (default 20; -1: no cap)")
    p.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs (default): requests run in arrival order; priority: by each request's priority "
                        "(lower first), the last preempted first")
    p.add_argument("--threads-per-stage", type=int, default=None, help="default: cores // stages")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default 512; 256 with several CPU stages)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once at most (default 64)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of prompt prefixes seen before (default: on)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV cache memory per stage, GiB (default: 1 on a CPU; on a GPU what "
                         "--gpu-memory-utilization leaves after the weights)")
    kv.add_argument("--kv-cache-memory-bytes", type=_num_bytes, default=None,
                    help="the same in bytes, as vLLM: 2147483648, 2Gi or 2G")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "int8"],
                   help="auto (default): the activations' dtype; int8 holds 4x the tokens of float32, with a scale "
                        "per block and KV head")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="requests may run with a LoRA adapter (a PEFT folder): serve's --lora-modules")
    p.add_argument("--max-loras", type=_positive("--max-loras"), default=None,
                   help="adapters the stages hold at once (default 1); requests of others wait for a slot")
    p.add_argument("--max-lora-rank", type=_positive("--max-lora-rank"), default=None,
                   help="largest adapter rank taken (default 16)")
    p.add_argument("--restart-on-failure", action=argparse.BooleanOptionalAction, default=None,
                   help="when a stage fails, start a new pipeline and re-run unfinished requests "
                        "(default: on for serve on one host, off otherwise)")
    # vLLM's flags that pipellm has no setting for: a value that asks for what pipellm does anyway passes, any other
    # gets what to give instead (pipellm/llm.py's engine_options)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--trust-remote-code", action="store_true", default=None, help=argparse.SUPPRESS)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=argparse.SUPPRESS)
    for flag in VLLM_ONLY_FLAGS[3:]:
        p.add_argument(f"--{flag.replace('_', '-')}", default=None, help=argparse.SUPPRESS)
    _multinode_args(p)
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "external_launcher"],
                   help="uni: one stage, in this process (the default for one stage on one host, except `serve`); "
                        "mp: stages in processes this one starts; external_launcher: torchrun started every process "
                        "(RANK 0 is the driver, 1.. the stages)")


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
    p.add_argument("--max-tokens", type=int, default=None, help="default: the generation config's max_new_tokens, "
                                                                "else 64")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the generation config's, "
                                                                   "else 0")
    p.add_argument("--top-p", type=float, default=None, help="default: the generation config's, else 1")
    p.add_argument("--top-k", type=int, default=None, help="default: the generation config's, else -1 (all)")
    shape = p.add_mutually_exclusive_group()  # structured outputs, as llama.cpp's flags
    shape.add_argument("--json-schema", default=None, help="hold the output to this JSON schema (a file, or the "
                                                           "schema itself)")
    shape.add_argument("--grammar", default=None, help="hold the output to this GBNF or Lark grammar (a file, or the "
                                                       "grammar itself)")
    shape.add_argument("--regex", default=None, help="hold the output to this regular expression")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for the flags not given: auto (default) = the model folder's "
                        "generation_config.json; vllm = none; or a folder holding a generation_config.json")


def _length_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: give a length (128) or a range (64-192)")
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--input-len {text!r}: need 1 <= min <= max")
    return lo, hi


def _model_and_prompts(args) -> None:
    """generate's words: the first is the model when --prompt is given or it names a model (an existing path, a word
    written as a path such as ./my-model or x.gguf, or a known name), unless --model is; the others are prompts. So
    `pipellm generate "The capital of France is"` runs the default model on that prompt, and a mistyped path is
    refused as a missing model rather than completed as a prompt."""
    from pipellm.loader.default_model import MODEL_NAMES
    words = list(args.words)
    if args.model is None and words and (args.prompt or words[0] in MODEL_NAMES
                                         or os.path.exists(os.path.expanduser(words[0]))
                                         or re.fullmatch(r"(\.{1,2}/|/|~)\S*|\S+\.gguf", words[0])):
        args.model = words.pop(0)
    args.prompts = words + (args.prompt or [])
    if not args.prompts:
        raise ValueError("no prompt: give prompts after the model, or with --prompt TEXT")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipellm", description="Pipeline-parallel LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts",
                         usage="pipellm generate [MODEL] [PROMPT ...] [--prompt PROMPT ...] [options]")
    gen.add_argument("words", nargs="*", metavar="MODEL | PROMPT",
                     help="the model (a folder, .gguf file or known name), then prompts. A first word that names no "
                          "model is a prompt for the default model; with --model, every word is a prompt")
    gen.add_argument("--prompt", action="append", default=None, help="a prompt to complete (repeatable)")
    _engine_args(gen, positional_model=False)
    _sampling_args(gen)
    gen.add_argument("--beam-width", type=int, default=None,
                     help="beam search with this many beams (HF's num_beams); prints every beam, best first")
    gen.add_argument("--length-penalty", type=float, default=None,
                     help="with --beam-width: beams rank by cum_logprob / length ** this (default 1)")
    chat = sub.add_parser("chat", help="chat in the terminal with the model's chat template")
    _engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--chat-template", default=None,
                      help="a Jinja chat template file, or the template itself (default: the model's)")
    bench = sub.add_parser("bench", help="offline throughput on generated requests")
    _engine_args(bench, positional_model=False)
    bench.add_argument("--num-prompts", type=_positive("--num-prompts"), default=32)
    bench.add_argument("--input-len", type=_length_range, default=(64, 192), help="prompt length or range, e.g. 64-192")
    bench.add_argument("--output-len", type=_positive("--output-len"), default=64)
    bench.add_argument("--compare-hf", action="store_true", help="also run HF transformers generate, same requests")
    bench.add_argument("--json", default=None, help="save every figure to this file")
    bench.add_argument("--roofline", action="store_true", help="also measure this machine's fp32 matmul rate and "
                       "memory bandwidth, and print each stage's share of them")
    bench.add_argument("--trace-dir", default=None, help="write trace.json, pipeline.png, kv_cache.png, summary.json")
    trace = sub.add_parser("trace", help="re-render a saved trace.json")
    trace.add_argument("trace_json")
    trace.add_argument("--png", default=None, help="pipeline picture to write (default: beside the trace)")
    inspect = sub.add_parser("inspect", help="what each layer predicts and attends to, stage by stage: lens.png, "
                                             "kv.png, inspect.json")
    _engine_args(inspect)
    inspect.add_argument("--prompt", default="The capital of France is")
    inspect.add_argument("--out", default="inspect", help="folder to write the pictures and inspect.json to")
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(serve)
    serve.add_argument("--lora-modules", nargs="+", default=(), type=_lora_module, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) clients ask for by NAME as the model (needs --enable-lora)")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters while the "
                            "server runs, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (needs --enable-lora)")
    serve.add_argument("--responses-store-size", type=int, default=1000,
                       help="the last N responses (each its input and output) kept in memory for "
                            "previous_response_id, GET /v1/responses/{id} and background mode (0: none, stateless)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics",
                       type=_non_empty("--api-key", "give the key, or leave the flag out to serve without one"))
    serve.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)",
                       type=_non_empty("--served-model-name", "give a name, or leave the flag out for --model's"))
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    serve.add_argument("--max-request-seqs", type=int, default=256, help="prompts x n one request may ask for")
    serve.add_argument("--max-request-tokens", type=int, default=1 << 20,
                       help="prompt + completion tokens one request may ask for, over all its choices")
    serve.add_argument("--max-waiting-seqs", type=int, default=1024,
                       help="sequences waiting for the engine; beyond, requests get 503 with Retry-After")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--generation-config", default="auto",
                       help="sampling defaults for fields a request leaves out: auto (default) = the model folder's "
                            "generation_config.json; vllm = none; or a folder holding a generation_config.json")
    serve.add_argument("--trace-dir", default=None, help="on shutdown, write the pipeline trace and pictures here")
    serve.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                       help="web pages whose scripts may call the API (CORS), e.g. http://localhost:3000, or *; "
                            "default: none")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file, or the template itself, for /v1/chat/completions (default: "
                            "the model's)")
    serve.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", "openai_gptoss"],
                       help="a thinking model's <think>...</think>, as chat messages' reasoning_content; "
                            "openai_gptoss: GPT-OSS's harmony analysis channel (a GPT-OSS model's default)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": the model decides when to call tools (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "openai"],
                       help="how the model writes its tool calls: hermes = <tool_call>{json}</tool_call> (Qwen2.5/3, "
                            "Hermes); llama3_json = the reply a JSON call (Llama 3.1-3.3); openai = harmony "
                            "messages to functions.NAME (GPT-OSS)")
    stage = sub.add_parser("stage", help="run this host's pipeline stages for a driver on another host")
    stage.add_argument("--model", default=None, help="this host's copy of the model (default: the driver's path)")
    _multinode_args(stage)
    stage.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the driver")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, with the positional model (and generate's prompts) sorted out."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [word for word in extra if word.startswith("-")] if args.command == "generate" else extra
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "generate":
        args.words += extra  # prompts after options: argparse takes only the first run of positionals
        _model_and_prompts(args)
    elif hasattr(args, "model_path"):
        if args.model_path and args.model and args.model_path != args.model:
            raise ValueError(f"two models given ({args.model_path!r} and --model {args.model!r}); give one")
        args.model = args.model_path or args.model
    return args
