"""Our own C++ kernels (see build.py), loaded once per process; None when they cannot be built here."""
import functools
import logging

log = logging.getLogger("pipellm")


@functools.cache
def load():
    """torch.ops.pipellm after loading the library (building it first if needed), or None with one warning."""
    import torch

    from pipellm.kernels.build import build

    try:
        torch.ops.load_library(build(quiet=True))
    except Exception as e:  # no compiler, or a platform the sources do not build on
        log.warning("compact-weight kernels unavailable (%s: %s); using the plain-torch path, which is slower",
                    type(e).__name__, str(e).splitlines()[0])
        return None
    return torch.ops.pipellm


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16_matmul() -> bool:
    """Whether torch's bf16 matmul has instructions to run on here (else it crawls, at ~1 GFLOP/s)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
