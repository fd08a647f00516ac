"""Our own C++ kernels (see build.py), loaded once per process; None when they cannot be built here."""
import functools
import logging

log = logging.getLogger("pipellm")


@functools.cache
def load():
    """The kernels' Python module, built first if needed, or None with one warning. PIPELLM_KERNELS names a built
    library to load instead (to compare two builds: a process holds one, since Python keeps an extension module by
    its name)."""
    import importlib.util
    import os

    import torch  # noqa: F401  (the module links against the torch libraries this import loads)

    from pipellm.kernels.build import build

    try:
        path = os.environ.get("PIPELLM_KERNELS") or build(quiet=True)
        spec = importlib.util.spec_from_file_location("pipellm_kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # no compiler, or a platform the sources do not build on
        log.warning("compact-weight kernels unavailable (%s: %s); using the plain-torch path, which is slower",
                    type(e).__name__, str(e).splitlines()[0])
        return None
    return module


def for_tensor(x):
    """The kernels for a tensor they can run on (they are CPU code: None for a GPU's), or None where not built."""
    return load() if x.device.type == "cpu" else None


GPU_FAILURE: list[str] = []  # why a GPU kernel's launch failed, once: the decodes gather from then on


def gpu():
    """The GPU's paged decode attention (triton_decode.py; CUDA builds of torch bring Triton), or None: Triton is
    missing, or the kernel failed once here."""
    return None if GPU_FAILURE else _triton_decode()


@functools.cache
def _triton_decode():
    try:
        from pipellm.kernels import triton_decode as module
    except ImportError as e:
        log.warning("GPU decode kernels unavailable (%s); decodes gather their K/V blocks instead", e)
        return None
    return module


def gpu_failed(e: Exception) -> None:
    """A GPU kernel's launch raised (Triton compiling for a GPU or shape it was not checked on): say so once, and
    let the decodes gather their blocks from now on rather than fail."""
    GPU_FAILURE.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    log.warning("the GPU decode kernel failed (%s); decodes gather their K/V blocks from now on", GPU_FAILURE[0])


@functools.cache
def cpuinfo(field: str) -> str:
    """A field of the first CPU in Linux's /proc/cpuinfo ("flags", "model name"); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags; empty where unknown."""
    return frozenset(cpuinfo("flags").split())


def has_bf16_matmul() -> bool:
    """Whether torch's bf16 matmul has instructions to run on here (else it crawls, at ~1 GFLOP/s)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
