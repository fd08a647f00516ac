"""Single-stream greedy decode rate of llama.cpp (llama-cpp-python) on a GGUF file, as decode_latency.py measures
pipellm's: (N - 1) / (time(N tokens) - time(1 token)). Imports neither torch nor pipellm, so it runs under any
Python that has llama_cpp, e.g. a venv of its own:
    python -m venv /tmp/lcpp && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/lcpp/bin/pip install llama-cpp-python
    /tmp/lcpp/bin/python benchmarks/llama_cpp_decode.py FILE.gguf [--threads 2] [--new-tokens 128]
Prints one JSON line: {"rate": tok/s}.
"""
import argparse
import json
import time

PROMPT = "The capital of France is"  # decode_latency.py's


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    from llama_cpp import Llama

    llm = Llama(args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def seconds(n: int) -> float:  # greedy, EOS ignored (generate() does not stop at it)
        start = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - start

    seconds(2)  # warm-up
    print(json.dumps({"rate": (args.new_tokens - 1) / (seconds(args.new_tokens) - seconds(1))}))


if __name__ == "__main__":
    main()
