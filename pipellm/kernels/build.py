"""Builds the compact-weight kernels (`python -m pipellm.kernels.build`; `make demo`/`make test` run it).

qgemm.cpp is compiled once per instruction set (generic, AVX2, AVX-512) and linked with ops.cpp, which picks one at
run time, so the library built on one x86-64 machine runs on any other, and with layer.cpp. The file name carries a
hash of the sources, the flags and the torch version: a stale build is never loaded.
"""
import hashlib
import logging
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("qgemm.h", "qgemm.cpp", "ops.h", "ops.cpp", "layer.cpp", "build.py")  # what the build's hash covers
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
ISA_FLAGS = {  # per instruction set: the flags its copy of qgemm.cpp is compiled with
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"] if X86 else [],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"] if X86 else [],
}
COMMON = ["-O3", "-std=c++17", "-fPIC", "-fno-math-errno"]
log = logging.getLogger("pipellm")


def _torch_flags() -> tuple[list[str], list[str]]:
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cflags = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    cflags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-fopenmp", "-fvisibility=hidden"]  # hidden: pybind11's advice
    lib = cpp_extension.library_paths()[0]
    # link torch's own libgomp (found through the rpath) so one OpenMP runtime serves torch and these kernels
    ldflags = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-lgomp"]
    return cflags, ldflags


def library_path() -> str:
    import torch

    h = hashlib.sha256(f"{torch.__version__}|{sys.version_info[:2]}|{COMMON}|{ISA_FLAGS}".encode())
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return os.path.join(HERE, "_build", f"pipellm_kernels-{h.hexdigest()[:16]}.so")


def build(quiet: bool = False) -> str:
    """Compiles the library unless it is already built; returns its path."""
    out = library_path()
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    cflags, ldflags = _torch_flags()
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
        jobs = []
        for isa, flags in ISA_FLAGS.items():
            obj = os.path.join(tmp, f"qgemm_{isa}.o")
            jobs.append((obj, [cxx, *COMMON, *flags, f"-DPIPELLM_ISA={isa}", "-c", os.path.join(HERE, "qgemm.cpp"),
                               "-o", obj]))
        for name in ("ops", "layer"):
            obj = os.path.join(tmp, f"{name}.o")
            jobs.append((obj, [cxx, *COMMON, *cflags, "-ffp-contract=off", "-c", os.path.join(HERE, f"{name}.cpp"),
                               "-o", obj]))
        procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)) for _, cmd in jobs]
        for cmd, p in procs:
            output, _ = p.communicate(timeout=600)
            if p.returncode:
                raise RuntimeError(f"compiling the kernels failed: {' '.join(cmd)}\n{output.decode()[-4000:]}")
        lib = os.path.join(tmp, "lib.so")
        cmd = [cxx, "-shared", "-fopenmp", *(o for o, _ in jobs), "-o", lib, *ldflags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"linking the kernels failed: {' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(lib, out)  # atomic: a concurrent loader sees no file or a whole one
    for old in os.listdir(os.path.dirname(out)):  # builds of earlier sources
        if old.startswith("pipellm_kernels-") and old != os.path.basename(out):
            os.remove(os.path.join(os.path.dirname(out), old))
    if not quiet:
        print(f"built {out}")
    return out


if __name__ == "__main__":
    build()
