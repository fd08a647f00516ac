"""Pictures of LLM.inspect's data: lens.png (what each layer's output predicts, stage by stage), kv.png (the
generated token's attention over each layer's own cache, and the blocks each stage's caches hold), and a terminal
summary."""
import json
import os

from pipellm.extras import pyplot

MAX_COLUMNS = 32  # prompt positions drawn: the last ones (inspect.json keeps them all)
DPI = 100


def _label(token: str, width: int = 9) -> str:
    text = token.strip().replace("\n", "\\n") or repr(token)
    return text if len(text) <= width else text[:width - 1] + "…"


def _stage_lines(ax, data: dict, labels: bool = True) -> None:
    """A line between the last layer of a stage and the first of the next; rows are layers, from 0 at the top."""
    for prev, nxt in zip(data["stages"], data["stages"][1:]):
        y = nxt["first_layer"] - 0.5
        ax.axhline(y, color="red", linewidth=2.5)
        if labels:
            ax.text(0.02, y, f"stage {prev['stage']} ↑ | ↓ stage {nxt['stage']}", transform=ax.get_yaxis_transform(),
                    va="center", ha="left", color="red", fontsize=8,
                    bbox={"facecolor": "white", "edgecolor": "red", "alpha": 0.85, "pad": 1.5})


def _layer_ticks(ax, data: dict) -> None:
    ax.set_yticks(range(len(data["layers"])))
    ax.set_yticklabels([f"{l['layer']} (s{l['stage']})" for l in data["layers"]], fontsize=7)
    ax.set_ylabel("layer (stage)")


def lens_size(num_layers: int, num_columns: int) -> tuple[float, float]:
    """Figure size in inches: a cell per (layer, position), a side panel, room for labels."""
    return 4.5 + 0.85 * num_columns + 2.5, 2.0 + 0.3 * num_layers


def render_lens(data: dict, path: str) -> None:
    import numpy as np
    plt = pyplot("drawing lens.png and kv.png")
    layers = data["layers"]
    cols = min(len(data["prompt_tokens"]), MAX_COLUMNS)
    first = len(data["prompt_tokens"]) - cols
    probs = np.array([l["top_probs"][first:] for l in layers])                          # [L, columns]
    fig, (ax, side) = plt.subplots(1, 2, figsize=lens_size(len(layers), cols), dpi=DPI, sharey=True,
                                   layout="constrained", gridspec_kw={"width_ratios": [0.85 * cols, 2.0]})
    im = ax.imshow(probs, aspect="auto", cmap="viridis", vmin=0, vmax=1)
    for row, layer in enumerate(layers):
        for col in range(cols):
            p = probs[row, col]
            ax.text(col, row, _label(layer["top_tokens"][first + col]), ha="center", va="center", fontsize=7,
                    color="black" if p > 0.5 else "white")
    ax.set_xticks(range(cols))
    ax.set_xticklabels([_label(t) for t in data["prompt_tokens"][first:]], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("prompt position (input token)" + (f", last {cols} of {len(data['prompt_tokens'])}" if first
                                                      else ""))
    _layer_ticks(ax, data)
    _stage_lines(ax, data)
    ax.set_title("top next-token prediction of final norm + LM head on each layer's output", fontsize=10)
    fig.colorbar(im, ax=side, shrink=0.6, label="probability of the top token")
    side.barh(range(len(layers)), [l["next_token_prob"] for l in layers], color="tab:orange")
    side.set_xlim(0, 1)
    side.set_title(f"P({_label(data['next_token'], 14)!r}) at the last\nposition, after each layer", fontsize=9)
    _stage_lines(side, data, labels=False)
    fig.suptitle(f"{data['model']}: {''.join(data['prompt_tokens'])!r} -> {data['next_token']!r}", fontsize=11)
    fig.savefig(path)
    plt.close(fig)


def kv_size(num_layers: int, num_columns: int, num_panels: int, most_stage_layers: int) -> tuple[float, float]:
    """Figure size in inches: attention panels on top (a row per layer), the stages' caches below."""
    return 2.5 + num_panels * (1.0 + 0.4 * num_columns), 4.0 + 0.22 * num_layers + 0.2 * most_stage_layers


def render_kv(data: dict, path: str) -> None:
    import numpy as np
    plt = pyplot("drawing lens.png and kv.png")
    layers, stages = data["layers"], data["stages"]
    attention = np.array([l["attention"] for l in layers])                               # [L, KV, K]
    num_kv, num_keys = attention.shape[1], attention.shape[2]
    heads = list(range(num_kv)) if num_kv <= 4 else []                                  # many heads: their mean
    panels = [(f"KV head {h}", attention[:, h]) for h in heads] or [(f"mean of {num_kv} KV heads",
                                                                      attention.mean(1))]
    cols = min(num_keys, MAX_COLUMNS)
    most = max(s["last_layer"] - s["first_layer"] + 1 for s in stages)
    fig = plt.figure(figsize=kv_size(len(layers), cols, len(panels), most), dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[1.1 * len(layers) + 6, most + 8])
    top = grid[0].subgridspec(1, len(panels))
    tokens = [_label(t) for t in data["cached_tokens"][-cols:]]
    for i, (title, values) in enumerate(panels):
        ax = fig.add_subplot(top[i])
        im = ax.imshow(values[:, -cols:], aspect="auto", cmap="magma", vmin=0, vmax=1)
        ax.set_xticks(range(cols))
        ax.set_xticklabels(tokens, rotation=60, ha="right", fontsize=7)
        if i == 0:
            _layer_ticks(ax, data)
        else:
            ax.set_yticks([])
        _stage_lines(ax, data, labels=i == 0)
        ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=fig.axes, shrink=0.6, label="attention weight")
    fig.suptitle(f"attention of the generated token {data['next_token']!r} (fed back as the next input) over the "
                 "cached positions of each layer's own KV cache", fontsize=10)
    bottom = grid[1].subgridspec(1, len(stages))
    size = data["block_size"]
    rms_max = max(max(l["kv_key_rms"]) for l in layers)
    for s, stage in enumerate(stages):
        own = [l for l in layers if l["stage"] == stage["stage"]]
        blocks = own[0]["kv_blocks"]
        slots = np.full((len(own), len(blocks) * size), np.nan)                     # [layers, the blocks' slots]
        for row, layer in enumerate(own):
            slots[row, :len(layer["kv_key_rms"])] = layer["kv_key_rms"]
        ax = fig.add_subplot(bottom[s])
        ax.imshow(slots, aspect="auto", cmap="Blues", vmin=0, vmax=rms_max, interpolation="nearest")
        for b in range(1, len(blocks)):
            ax.axvline(b * size - 0.5, color="black", linewidth=1)
        ax.set_xticks([b * size + size / 2 - 0.5 for b in range(len(blocks))])
        ax.set_xticklabels([f"block {b}" for b in blocks], fontsize=7)
        ax.set_xlabel(f"slots of the sequence's blocks ({size} a block): RMS of each cached key, blank = free",
                      fontsize=7)
        ax.set_yticks(range(len(own)))
        ax.set_yticklabels([str(l["layer"]) for l in own], fontsize=6)
        ax.set_title(f"stage {stage['stage']}: K/V caches of layers {stage['first_layer']}-{stage['last_layer']}, "
                     "one tensor each\n" + ("hidden states go on to the next stage; caches stay"
                                            if s < len(stages) - 1 else "+ final norm, LM head, sampler"), fontsize=8)
    fig.savefig(path)
    plt.close(fig)


def save_inspect(data: dict, out_dir: str) -> dict:
    """Writes inspect.json, lens.png and kv.png into out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in ("inspect.json", "lens.png", "kv.png")}
    with open(paths["inspect.json"], "w") as f:
        json.dump(data, f, indent=1, ensure_ascii=False)
    render_lens(data, paths["lens.png"])
    render_kv(data, paths["kv.png"])
    return paths


def summary(data: dict) -> str:
    """Per layer, grouped by stage: the top token at the last prompt position and its probability."""
    lines = [f"{''.join(data['prompt_tokens'])!r} -> {data['next_token']!r}"]
    for stage in data["stages"]:
        lines.append(f"stage {stage['stage']}: layers {stage['first_layer']}-{stage['last_layer']}")
        for layer in data["layers"][stage["first_layer"]:stage["last_layer"] + 1]:
            lines.append(f"  layer {layer['layer']:>3}  {layer['top_tokens'][-1]!r:<16} {layer['top_probs'][-1]:.3f}"
                         f"   P({data['next_token']!r}) {layer['next_token_prob']:.3f}")
    return "\n".join(lines)
