from dataclasses import dataclass


@dataclass(frozen=True)
class StageLayers:
    rank: int
    start: int          # first layer held
    end: int            # one past the last layer held
    is_first: bool      # holds the embedding
    is_last: bool       # holds the final norm, LM head and sampler

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        parts = ["embed"] if self.is_first else []
        parts.append(f"layers {self.start}-{self.end - 1}")
        if self.is_last:
            parts.append("norm + lm_head")
        return f"stage {self.rank}: " + " + ".join(parts)


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    # vLLM's rule: leftover layers go to the earliest stages, never the last (it also runs norm + head).
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    for i in range(extra):
        sizes[i] += 1
    return sizes


def parse_partition(text: str) -> list[int] | str:
    """A partition as the CLI writes it: "auto", or layer counts per stage such as "15,15"."""
    if text.strip() == "auto":
        return "auto"
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"layer_partition {text!r}: give layer counts per stage, such as \"15,15\" or [15, 15], "
                         "or \"auto\"") from None


def make_partition(num_layers: int, num_stages: int, layer_partition: list[int] | None = None) -> list[StageLayers]:
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} is greater than the model's {num_layers} layers; "
                         f"use at most {num_layers} stages")
    if layer_partition is None:
        sizes = even_partition(num_layers, num_stages)
    else:
        sizes = list(layer_partition)
        if len(sizes) != num_stages:
            raise ValueError(f"layer_partition={sizes} has {len(sizes)} entries but pipeline_parallel_size="
                             f"{num_stages}; give one layer count per stage")
        if any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"layer_partition={sizes}: every stage needs at least one layer")
        if sum(sizes) != num_layers:
            raise ValueError(f"layer_partition={sizes} sums to {sum(sizes)}, but the model has {num_layers} layers")
    stages, start = [], 0
    for rank, n in enumerate(sizes):
        stages.append(StageLayers(rank, start, start + n, rank == 0, rank == num_stages - 1))
        start += n
    return stages


def node_of_stage(rank: int, num_stages: int, nnodes: int) -> int:
    """Hosts get contiguous, even runs of stages (node 0, the driver's host, the first run)."""
    return rank * nnodes // num_stages
