"""Where a stage computes: the CPU, or a CUDA device of its host (`EngineConfig.device`).

"cpu"; "cuda": the stage with local rank i on its host takes that host's i-th visible GPU; "cuda:N": every stage
of the host on GPU N (several stages may share one); "auto": cuda where the host has a GPU, else cpu. Each stage
resolves the name on its own host, so a pipeline over hosts with and without GPUs mixes both kinds."""
import contextlib
import os
import re
import socket

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE_PATTERN = re.compile(r"cpu|auto|cuda(:\d+)?")
GPU_RESERVE_BYTES = 1 << 30  # a stage's CUDA context, cuBLAS workspace and activations, besides weights and KV cache
# oneDNN, which runs torch's bf16 matmuls on CPUs with bf16 instructions, keeps a compiled kernel (~0.5-0.9 MB) for
# every matmul shape it meets, up to 1,024 in each of two caches: batches of ever-changing token counts grew a stage
# by ~1 GB. A step needs a few shapes a layer; 32 bounds the growth at ~40 MB. Read at the first matmul.
ONEDNN_CACHE_VARS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32", "LRU_CACHE_CAPACITY": "32"}
# cuDNN's attention, which torch picks first on recent GPUs, plans each new shape it meets (~3 ms each). A decode
# group's shapes recur (a step's sequences and blocks of context), but each prefill chunk brings a new one: an H200
# spent 0.2-0.6 s on a prefill step of 512 tokens. The flash and memory-efficient kernels take any shape as it comes
# (though on decodes an H200 ran a step in 33 ms with them against 17 ms with cuDNN's).
PREFILL_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def prefill_attention_backends(dev: torch.device):
    """The context a layer's prefill chunks attend in: SDPA's shape-agnostic kernels on a GPU (~12 us to enter)."""
    return sdpa_kernel(PREFILL_ATTENTION_BACKENDS) if dev.type == "cuda" else contextlib.nullcontext()


def bound_onednn_caches() -> None:
    """Before this process's first bf16 matmul: a stage's, or the driver's (dtype="auto" times one there, and a
    one-stage pipeline's stage runs there). oneDNN reads these once. A user's own setting wins."""
    for name, value in ONEDNN_CACHE_VARS.items():
        os.environ.setdefault(name, value)


def check_name(device: str) -> None:
    if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f"device={device!r}: must be \"cpu\", \"cuda\", \"cuda:N\" (one GPU for every stage of a "
                         "host) or \"auto\"")


def cuda_missing() -> str | None:
    """Why this process cannot use CUDA, in one line; None when it can."""
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU build without CUDA; install a CUDA build of torch "
                f"{torch.__version__.split('+')[0]}, or use device=\"cpu\"")
    if not torch.cuda.is_available():
        return "torch has CUDA but sees no GPU here (check the driver and CUDA_VISIBLE_DEVICES), or use device=\"cpu\""
    return None


def resolve(device: str) -> str:
    """device with "auto" decided for this host: "cpu", "cuda" or "cuda:N"; ValueError when CUDA is asked for and
    missing, or a GPU index is past the host's GPUs."""
    check_name(device)
    if device == "auto":
        return "cpu" if cuda_missing() else "cuda"
    if device.startswith("cuda"):
        if (why := cuda_missing()) is not None:
            raise ValueError(f"device={device!r}: {why}")
        count = torch.cuda.device_count()
        if ":" in device and int(device.split(":")[1]) >= count:
            raise ValueError(f"device={device!r}: this host has {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return device


def check_gpu_options(config, resolved: str) -> None:
    """An EngineConfig's options that a GPU device cannot take, and (stages that pipellm starts on this host) whether
    it has a GPU for each stage."""
    for name in ("quantization", "int8_activations"):
        if getattr(config, name):
            raise ValueError(f"{name}={getattr(config, name)!r}: compact weights on a GPU are dequantized to the "
                             f"activations' dtype at load (our compact kernels are CPU code); leave {name} unset "
                             "with a GPU device")
    if config.nnodes == 1 and config.distributed_executor_backend in ("uni", "mp"):
        stage_device(resolved, 0, config.pipeline_parallel_size)


def stage_device(device: str, local_rank: int, local_world_size: int, num_gpus: int | None = None) -> torch.device:
    """The torch device of the local_rank-th of local_world_size stages on this host, for a resolved name."""
    if device == "cpu":
        return torch.device("cpu")
    if ":" in device:
        return torch.device(device)
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if local_world_size > num_gpus:
        raise ValueError(f"device=\"cuda\": {local_world_size} stages on this host but it has {num_gpus} GPU(s), and "
                         "each stage takes one of its own; start at most that many stages here, or give "
                         "device=\"cuda:0\" to put them all on one GPU")
    return torch.device("cuda", local_rank)


def gpu_dtype() -> str:
    """The default activations' dtype on this host's GPUs: bf16, or fp16 where bf16 is missing."""
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def identity(dev: torch.device) -> str:
    """What tells two stages' devices apart across processes: a GPU's UUID, or the host for a CPU."""
    if dev.type == "cuda":
        return f"cuda/{torch.cuda.get_device_properties(dev).uuid}"
    return f"cpu/{socket.gethostname()}"


def uses_nccl(mine: str, peer: str) -> bool:
    """Whether hidden states between two neighbouring stages go over NCCL: both on GPUs, and not the same GPU
    (NCCL refuses two ranks on one device). Otherwise they pass through host memory, over gloo."""
    return mine.startswith("cuda/") and peer.startswith("cuda/") and mine != peer


def host_memory_available() -> int | None:
    """Bytes of memory this host can give a new allocation without swapping (Linux's MemAvailable, within the
    container's cgroup limit), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                avail = min(avail, int(f.read()) - int(g.read()))  # "max" (no limit) fails int(): skipped
        except (OSError, ValueError):
            continue
    return avail


def kv_cache_bytes(total_bytes: int, utilization: float, weight_bytes: int, stages_on_gpu: int) -> int:
    """A stage's KV cache budget on a GPU: its share of total_bytes * utilization, less its weights and a reserve
    for the context and activations (vLLM's gpu_memory_utilization: the share of the GPU this engine may use)."""
    return int(total_bytes * utilization) // stages_on_gpu - weight_bytes - GPU_RESERVE_BYTES


def stage_params(cfg, stage) -> int:
    """Parameters a stage holds (every expert of a MoE layer; norms and biases aside), a ModelConfig's and a
    StageLayers': its GPU memory is planned before it loads."""
    return sum(cfg.layer_weights(layer) for layer in range(stage.start, stage.end)) \
        + cfg.vocab_size * cfg.hidden_size * (stage.is_first + stage.is_last)


def gpu_kv_cache_gib(device: str, cfg, stages: list, dtype_bytes: int, utilization: float, nnodes: int) -> float:
    """kv_cache_gib for stages on GPUs like this host's (a resolved "cuda" or "cuda:N"): the smallest budget of any
    stage, so one block count fits every stage."""
    gpu = int(device.split(":")[1]) if ":" in device else 0
    total = torch.cuda.get_device_properties(gpu).total_memory
    sharing = -(-len(stages) // nnodes) if ":" in device else 1  # stages on one GPU
    budgets = [kv_cache_bytes(total, utilization, stage_params(cfg, s) * dtype_bytes, sharing) for s in stages]
    worst = min(range(len(stages)), key=budgets.__getitem__)
    if budgets[worst] <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: stage {worst}'s weights "
                         f"(~{stage_params(cfg, stages[worst]) * dtype_bytes / 2 ** 30:.1f} GiB) leave no room for a "
                         f"KV cache in its share of a {total / 2 ** 30:.0f} GiB GPU; raise it, use more stages, or "
                         "give kv_cache_gib")
    return budgets[worst] / 2 ** 30
