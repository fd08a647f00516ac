"""A model's folder: where a model name, a path or a .gguf file lead to, and its tokenizer."""
import json
import os

from pipellm.loader.gguf import cached_gguf_folder, gguf_source

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers' one fast tokenizer class


def resolve_model(model: str | None) -> str:
    """A model folder with config.json and safetensors, converting a GGUF file (cached) when given one."""
    from pipellm.loader.default_model import MODEL_NAMES, default_model_path, named_model_path

    if model in MODEL_NAMES and not os.path.exists(model):
        path = named_model_path(model)
    else:
        path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(f"model {path!r} does not exist; pass a folder with config.json and *.safetensors, "
                         f"a .gguf file, one of the names {', '.join(MODEL_NAMES)}, or None for the default model")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return cached_gguf_folder(path)
        raise ValueError(f"model {path!r} is a file but not .gguf; pass a model folder or a .gguf file "
                         "(pickle checkpoints such as .bin/.pt are refused)")
    return path


def load_tokenizer(folder: str):
    """The model's tokenizer, or None when the folder has none (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if gguf_source(folder) is not None and _tokenizer_class(folder) in GENERIC_TOKENIZERS:
        # our folder from a GGUF file, its tokenizer saved as transformers' generic fast one: the class AutoTokenizer
        # gives it too, but only after importing the model's config classes and more (~1.2 s of a start)
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def _tokenizer_class(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None
