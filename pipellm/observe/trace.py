"""A picture of the pipeline at work: per-batch timings of every stage, as a Chrome/Perfetto trace, PNG charts
and a summary. Stages record (kind, batch, start, end, tokens, sequences) events only when tracing is on."""
import json
import os
import time
from dataclasses import dataclass, field

from pipellm.extras import pyplot, require_extra

WAIT_KINDS = {"wait_batch": "wait for batch", "wait_hidden": "wait for activations"}


@dataclass
class TraceRecorder:
    """Driver-side events: when each batch was sent and its tokens came back, and KV blocks in use."""
    batches: list[dict] = field(default_factory=list)
    kv: list[tuple[float, int, int]] = field(default_factory=list)  # (time, blocks in use, blocks shared)
    generated_tokens: int = 0
    clock_offset_s: float = field(default_factory=lambda: time.time() - time.perf_counter())
    stage_events: dict[int, list[dict]] = field(default_factory=dict)  # rank -> events, wall clock

    def __post_init__(self):
        # a trace ends in its pictures: say that matplotlib is missing now, not after the run
        require_extra("plot", "tracing (trace_dir=, --trace-dir), which draws pipeline.png and kv_cache.png,")

    def add_reports(self, reports) -> None:
        """Keeps the events that stage reports hand over (every inspect() drains them from the stages)."""
        for report in reports:
            self.stage_events.setdefault(report.rank, []).extend(
                dict(kind=k, batch=b, start=s + report.clock_offset_s, end=e + report.clock_offset_s, tokens=t,
                     seqs=n) for k, b, s, e, t, n in (report.events or []))

    def on_submit(self, batch_id: int, num_tokens: int, num_seqs: int, blocks_used: int, blocks_shared: int):
        now = time.perf_counter()
        self.batches.append(dict(batch=batch_id, submit=now, tokens=num_tokens, seqs=num_seqs))
        self.kv.append((now, blocks_used, blocks_shared))

    def on_receive(self, batch_id: int, num_sampled: int) -> None:
        for b in reversed(self.batches):
            if b["batch"] == batch_id:
                b["done"] = time.perf_counter()
                break
        self.generated_tokens += num_sampled


def collect(engine) -> dict:
    """Everything recorded since the last collect, on one wall-clock time base (seconds). Call between steps."""
    reports = engine.inspect()
    rec: TraceRecorder = engine.tracer
    engine.tracer = TraceRecorder()
    stages = []
    for report in reports:
        events = rec.stage_events.get(report.rank, [])
        bytes_per_token = report.activation_bytes_sent / max(1, report.activation_tokens_sent)
        stages.append(dict(rank=report.rank, description=report.description, events=events,
                           num_layers=report.num_kv_caches, bytes_sent_per_token=bytes_per_token,
                           kv_cache_shape=list(report.kv_cache_shape)))
    off = rec.clock_offset_s
    return dict(
        stages=stages,
        driver=[dict(b, submit=b["submit"] + off, done=b.get("done", b["submit"]) + off) for b in rec.batches],
        kv=[(t + off, used, shared) for t, used, shared in rec.kv],
        num_blocks=engine.num_blocks, block_size=engine.config.block_size,
        generated_tokens=rec.generated_tokens)


def summarize(data: dict) -> dict:
    forwards = [e for s in data["stages"] for e in s["events"] if e["kind"] == "forward"]
    if not forwards:
        return {"bubble_pct": 0.0, "stages": [], "balance": 1.0, "tokens_per_s": 0.0, "window_s": 0.0}
    start, end = min(e["start"] for e in forwards), max(e["end"] for e in forwards)
    window = max(end - start, 1e-9)
    busy = [sum(e["end"] - e["start"] for e in s["events"] if e["kind"] == "forward") for s in data["stages"]]
    mean_busy = sum(busy) / len(busy)
    peak_blocks = max((used for _, used, _ in data["kv"]), default=0)
    return {
        "window_s": window,
        # Time stages sat idle between the first and the last forward, while work was pending.
        "bubble_pct": 100 * (1 - mean_busy / window),
        "balance": max(busy) / mean_busy if mean_busy else 1.0,  # slowest stage's time over the mean
        "tokens_per_s": data["generated_tokens"] / window,
        "stages": [dict(rank=s["rank"], description=s["description"], busy_pct=100 * b / window,
                        busy_s=b, bytes_sent_per_token=s["bytes_sent_per_token"], kv_blocks=data["num_blocks"],
                        kv_blocks_peak_in_use=peak_blocks, num_layers=s["num_layers"])
                   for s, b in zip(data["stages"], busy)],
    }


def to_chrome_trace(data: dict) -> dict:
    """Chrome trace event format (Perfetto, chrome://tracing): a track per stage, a slice per batch forward."""
    times = [e["start"] for s in data["stages"] for e in s["events"]] + [b["submit"] for b in data["driver"]]
    t0 = min(times, default=0.0)
    us = lambda t: (t - t0) * 1e6  # noqa: E731
    events = []
    driver_pid = len(data["stages"])
    for s in data["stages"]:
        events.append(dict(ph="M", name="process_name", pid=s["rank"], args=dict(name=s["description"])))
        events.append(dict(ph="M", name="process_sort_index", pid=s["rank"], args=dict(sort_index=s["rank"])))
        events.append(dict(ph="M", name="thread_name", pid=s["rank"], tid=0, args=dict(name="compute")))
        events.append(dict(ph="M", name="thread_name", pid=s["rank"], tid=1, args=dict(name="waits")))
        for e in s["events"]:
            is_forward = e["kind"] == "forward"
            events.append(dict(ph="X", pid=s["rank"], tid=0 if is_forward else 1, ts=us(e["start"]),
                               dur=(e["end"] - e["start"]) * 1e6,
                               name=f"batch {e['batch']}" if is_forward else WAIT_KINDS[e["kind"]],
                               args=dict(batch=e["batch"], tokens=e["tokens"], requests=e["seqs"])))
    events.append(dict(ph="M", name="process_name", pid=driver_pid, args=dict(name="driver")))
    for b in data["driver"]:
        events.append(dict(ph="i", s="t", pid=driver_pid, tid=0, ts=us(b["submit"]), name=f"send batch {b['batch']}",
                           args=dict(tokens=b["tokens"], requests=b["seqs"])))
        events.append(dict(ph="i", s="t", pid=driver_pid, tid=0, ts=us(b["done"]), name=f"tokens of batch {b['batch']}"))
    for t, used, shared in data["kv"]:
        events.append(dict(ph="C", pid=driver_pid, name="KV blocks", ts=us(t), args=dict(in_use=used, shared=shared)))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summarize(data), "pipellm": data}


def render_pipeline_png(data: dict, path: str) -> None:
    """Gantt chart: stages as rows, time across, one colour per micro-batch so a batch can be followed."""
    plt = pyplot("drawing pipeline.png and kv_cache.png")

    summary = summarize(data)
    stages = data["stages"]
    forwards = [e for s in stages for e in s["events"] if e["kind"] == "forward"]
    t0 = min((e["start"] for e in forwards), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.9 * len(stages)), dpi=100)
    colors = plt.get_cmap("tab10").colors
    for s in stages:
        row = len(stages) - 1 - s["rank"]  # stage 0 on top
        for e in s["events"]:
            if e["kind"] != "forward":
                continue
            left, width = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            ax.barh(row, width, left=left, height=0.7, color=colors[e["batch"] % len(colors)], edgecolor="white",
                    linewidth=0.3)
    ax.set_yticks(range(len(stages)), [s["description"] for s in reversed(stages)])
    ax.set_xlabel("time (ms); one colour per micro-batch, gaps are idle time (bubbles)")
    ax.set_title(f"pipellm pipeline: {len(stages)} stage(s) · bubble {summary['bubble_pct']:.1f}% · "
                 f"{summary['tokens_per_s']:.1f} generated tok/s · balance {summary['balance']:.2f}")
    ax.set_xlim(left=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render_kv_png(data: dict, path: str) -> None:
    """KV blocks in use over time, with the blocks shared through prefix caching shown apart. Every layer of
    every stage uses the same block ids, so one curve holds for each of them."""
    plt = pyplot("drawing pipeline.png and kv_cache.png")

    fig, ax = plt.subplots(figsize=(10, 4), dpi=100)
    if data["kv"]:
        t0 = data["kv"][0][0]
        ts = [(t - t0) * 1e3 for t, _, _ in data["kv"]]
        shared = [s for _, _, s in data["kv"]]
        private = [u - s for _, u, s in data["kv"]]
        ax.stackplot(ts, shared, private, labels=["shared (prefix cache)", "private"], step="post",
                     colors=["tab:orange", "tab:blue"])
    ax.axhline(data["num_blocks"], color="black", linestyle="--", linewidth=1, label="blocks in the cache")
    layers = ", ".join(f"stage {s['rank']}: {s['num_layers']} layers" for s in data["stages"])
    ax.set_title(f"KV cache blocks in use (block = {data['block_size']} tokens; same ids in every layer; {layers})")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("blocks")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_trace_dir(data: dict, out_dir: str) -> dict:
    """Writes trace.json, pipeline.png, kv_cache.png and summary.json; returns the summary."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "trace.json"), "w") as f:
        json.dump(to_chrome_trace(data), f)
    summary = summarize(data)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    render_pipeline_png(data, os.path.join(out_dir, "pipeline.png"))
    render_kv_png(data, os.path.join(out_dir, "kv_cache.png"))
    return summary


def save_trace(engine, out_dir: str) -> dict:
    """Lets the batches still in flight come back (submitting none), then writes the trace directory."""
    while engine.in_flight:
        engine.step(fill=False)
    return write_trace_dir(collect(engine), out_dir)


def load_trace(path: str) -> dict:
    with open(path) as f:
        try:
            trace = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a trace written by pipellm (not JSON: {e})") from None
    if not isinstance(trace, dict) or "pipellm" not in trace:
        raise ValueError(f"{path}: not a trace written by pipellm (no 'pipellm' section)")
    return trace["pipellm"]
