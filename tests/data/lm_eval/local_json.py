"""Loads a task's JSON Lines file from this folder, for the YAMLs' `custom_dataset`: lm-eval resolves a relative
`dataset_kwargs.data_files` against the working directory, not the YAML's folder, and this never touches the hub."""
import json
from pathlib import Path

import datasets


def load(data_files: str, **_) -> datasets.DatasetDict:
    """{"test": the rows of data_files, a path relative to this folder}; lm-eval passes the task's metadata too."""
    with open(Path(__file__).parent / data_files) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
