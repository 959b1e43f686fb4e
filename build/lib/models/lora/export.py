"""The exports of a LoRA run: its adapters as peft saves them, or its base with them merged in.

A LoRA run of ``recipes.lm`` keeps peft's ``adapter_config.json`` in ``OUTPUT_DIR/peft/``; it
names the base weights (``base_model_name_or_path``), which the run's checkpoints leave out.

- ``--format peft``: ``adapter_config.json`` and ``adapter_model.safetensors`` under the names
  peft saves (``base_model.model.<layer>.lora_A.weight``), which
  ``PeftModel.from_pretrained(base_model, DEST)`` loads.
- ``--format hf``: the base weights with each adapted layer's ``W + alpha / r * B @ A`` (peft's
  ``merge_and_unload``) under the base model's names, for ``from_pretrained`` without peft.

Neither needs peft installed: the adapters are tensors and the config is JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from models.hf.export import PEFT_FILES_DIR, partial_directory, publish_directory

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# ``<layer>.lora_A.<adapter>.weight``: the adapters' names in the model and its checkpoints.
_ADAPTER_KEY = re.compile(r"^(?P<layer>.+)\.lora_(?P<ab>[AB])\.[^.]+\.weight$")


def is_lora_run(output_dir: Path) -> bool:
    return (output_dir / PEFT_FILES_DIR / ADAPTER_CONFIG).is_file()


def _adapter_config(output_dir: Path) -> dict[str, object]:
    path = output_dir / PEFT_FILES_DIR / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(
            f"{output_dir} has no {PEFT_FILES_DIR}/{ADAPTER_CONFIG}: it is not a LoRA run, so it "
            "has no adapters to export. Use --format hf or pt, or train with lora.rank set."
        )
    config: dict[str, object] = json.loads(path.read_text())
    return config


def _adapters(state: Mapping[str, object]) -> dict[str, dict[str, Tensor]]:
    """Each adapted layer's ``{"A": ..., "B": ...}`` from a checkpoint's model state."""
    layers: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        match = _ADAPTER_KEY.match(key)
        if match is not None and isinstance(value, Tensor):
            layers.setdefault(match["layer"], {})[match["ab"]] = value
    return layers


def write_peft_directory(
    state: Mapping[str, object], output_dir: Path, destination: Path
) -> list[Path]:
    """Write the adapters of ``state`` as a peft adapter directory; the files written."""
    from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]

    config = _adapter_config(output_dir)
    partial = partial_directory(destination)
    tensors = {
        f"base_model.model.{layer}.lora_{ab}.weight": tensor.detach().contiguous().clone()
        for layer, pair in _adapters(state).items()
        for ab, tensor in pair.items()
    }
    save_file(tensors, str(partial / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config["inference_mode"] = True
    (partial / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return publish_directory(partial, destination)


def base_model_path(output_dir: Path) -> Path:
    """The base weights a LoRA run's adapters go with (its ``adapter_config.json`` names them)."""
    return Path(str(_adapter_config(output_dir)["base_model_name_or_path"]))


def merged_state(
    state: Mapping[str, object], output_dir: Path, base: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The ``base`` model's weights (those :func:`base_model_path` names) with the adapters of
    ``state`` merged in, under its names."""
    config = _adapter_config(output_dir)
    if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            "The run's adapters scale by rank- or layer-specific factors, which this export "
            "does not merge. Export --format peft and merge with peft's merge_and_unload()."
        )
    merged = {key: base[key] for key in base}
    for key, value in state.items():
        if isinstance(value, Tensor) and _ADAPTER_KEY.match(key) is None:
            merged[key.replace(".base_layer.", ".")] = value
    scaling = float(str(config["lora_alpha"])) / float(str(config["r"]))
    for layer, pair in _adapters(state).items():
        key = f"{layer}.weight"
        if key not in merged:
            raise ValueError(
                f"The base weights in {base_model_path(output_dir)} have no {key} for the adapters of {layer}: "
                "they are not the weights the run adapted."
            )
        weight = merged[key]
        delta = scaling * (pair["B"].float() @ pair["A"].float())
        merged[key] = (weight.float() + delta).to(weight.dtype)
    return merged
