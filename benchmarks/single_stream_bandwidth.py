"""Single-stream decode of the default model at PP=1 against the memory bandwidth limit (the hot-path issue's target:
>= 80% of it): every weight is read once a token, so the limit is (the stage's weight bytes) / (read bandwidth,
measured in the same run with the same threads). Its compact GGUF weights and the same weights dense in fp32.
    python benchmarks/single_stream_bandwidth.py [--rounds 3] [--json out.json]"""
import argparse
import json
import os
import statistics
import tempfile

from decode_latency import decode_rate, pipellm_generator

from pipellm import LLM
from pipellm.loader.default_model import default_model_path
from pipellm.loader.gguf import convert_gguf
from pipellm.observe.roofline import measure_limits
from pipellm.quant.linear import MAPPED


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gguf_file = default_model_path()
    tmp = tempfile.TemporaryDirectory()
    dense = os.path.join(tmp.name, "fp32")
    convert_gguf(gguf_file, dense)
    results = {}
    for name, model in (("compact", gguf_file), ("dense_fp32", dense)):
        with LLM(model, dtype="float32", kv_cache_gib=0.0625, max_model_len=1024) as llm:
            # a table only looked up (mapped from its file) is read a row a token; the rest whole
            weights = sum(n for f, n in llm.engine.inspect()[0].weight_bytes if not f.endswith(MAPPED))
            gen = pipellm_generator(llm)
            gen(2)  # warm-up
            rates, shares = [], []
            for _ in range(args.rounds):  # the bandwidth next to each measure: the machine's load drifts
                bandwidth = measure_limits(llm.engine.config.num_threads, 8, 576, 1536)["read_bytes_s"]
                rates.append(decode_rate(gen, args.new_tokens))
                shares.append(rates[-1] * weights / bandwidth)
        results[name] = {"weight_bytes": weights, "decode_tok_s": rates, "bandwidth_share": shares}
        print(f"{name:10s} {weights / 1e6:6.0f} MB of weights, {statistics.median(rates):6.1f} tok/s, "
              f"{statistics.median(shares):.0%} of the read bandwidth (rounds: "
              + ", ".join(f"{s:.0%}" for s in shares) + ")", flush=True)
    tmp.cleanup()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results | {"args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
