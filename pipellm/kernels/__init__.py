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
