"""Reading a Hugging Face checkpoint folder (shared by the Megatron loader and the weight sync)."""

from __future__ import annotations

import json
import os


def safetensor_files(path: str) -> list[str]:
    """The ``.safetensors`` files of the checkpoint folder ``path`` (full paths): the ones its
    ``model.safetensors.index.json`` names (sorted, each once), else ``model.safetensors``."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = ["model.safetensors"]
    return [os.path.join(path, name) for name in names]
