"""A run's model as a Hugging Face directory (``python -m runtime export OUTPUT_DIR DEST --format hf``).

A recipe that trains a Hugging Face-compatible model keeps the model's ``config.json`` and its
tokenizer files in ``OUTPUT_DIR/hf/`` (:func:`write_hf_files`; ``recipes.lm`` does); export
writes them beside the checkpoint's weights as safetensors (tied embeddings once; a mixture of
experts' experts one tensor per expert, as ``save_pretrained`` writes them), one file or shards
of at most ``max_shard_bytes`` with the ``model.safetensors.index.json`` that
``from_pretrained`` reads. The directory is written under a
temporary name and renamed when complete, so DEST is either whole or absent.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.hf.conversion import checkpoint_state

HF_FILES_DIR = "hf"
PEFT_FILES_DIR = "peft"
"""Where a LoRA run keeps peft's ``adapter_config.json`` (not in ``hf/``: ``from_pretrained``
would take a directory holding one for an adapter)."""
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_hf_files(
    output_dir: Path,
    *,
    config: Mapping[str, Any],
    tokenizer_path: Path | None,
    model_dir: Path | None = None,
) -> None:
    """Keep the model's ``config`` (its config.json), the tokenizer files beside
    ``tokenizer_path`` and ``model_dir``'s generation_config.json in ``OUTPUT_DIR/hf/``, which
    :func:`write_hf_directory` reads; one rank writes them. Replaced whole, never half-written."""
    target = output_dir / HF_FILES_DIR
    partial_dir = output_dir / f"{HF_FILES_DIR}.partial"
    shutil.rmtree(partial_dir, ignore_errors=True)
    partial_dir.mkdir(parents=True)
    (partial_dir / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    if tokenizer_path is not None:
        for name in _TOKENIZER_FILES:
            source = Path(tokenizer_path).parent / name
            if source.is_file():
                shutil.copy2(source, partial_dir / name)
    if model_dir is not None:
        source = model_dir / "generation_config.json"
        if source.is_file():
            shutil.copy2(source, partial_dir / source.name)
    shutil.rmtree(target, ignore_errors=True)
    partial_dir.replace(target)


def write_hf_directory(
    state: Mapping[str, object],
    output_dir: Path,
    destination: Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``state`` with the run's ``hf/`` files as a Hugging Face directory; the files written."""
    from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]

    source = output_dir / HF_FILES_DIR
    if not (source / "config.json").is_file():
        raise ValueError(
            f"{output_dir} has no {HF_FILES_DIR}/config.json, so its model cannot be written as a "
            "Hugging Face directory. --format hf needs a run of a recipe that keeps one "
            "(recipes.lm does); export to a .pt file instead."
        )
    partial = partial_directory(destination)
    tensors = _stored_once(
        {
            key: value.detach().contiguous().clone()
            for key, value in state.items()
            if isinstance(value, Tensor)
        },
        json.loads((source / "config.json").read_text()),
    )
    tensors = _as_saved(tensors, source)
    shards = _shards(tensors, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, str(partial / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
            "weight_map": {
                key: name for name, shard in zip(names, shards, strict=True) for key in shard
            },
        }
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    for file in sorted(source.iterdir()):
        if file.is_file():
            shutil.copy2(file, partial / file.name)
    return publish_directory(partial, destination)


def partial_directory(destination: Path) -> Path:
    """A fresh, empty directory beside ``destination`` (which must be new or empty) to write an
    export into; :func:`publish_directory` renames it to ``destination`` when complete."""
    if destination.exists() and any(destination.iterdir()):
        raise ValueError(f"{destination} exists and is not empty. Give a new directory.")
    partial = destination.with_name(destination.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish_directory(partial: Path, destination: Path) -> list[Path]:
    """Rename the complete ``partial`` to ``destination``; the files in it."""
    if destination.exists():
        destination.rmdir()
    partial.replace(destination)
    return sorted(destination.iterdir())


def _stored_once(tensors: dict[str, Tensor], config: Mapping[str, object]) -> dict[str, Tensor]:
    """Tied input and output embeddings once, as Hugging Face stores them: the checkpoint holds
    the weight under both names, the export leaves out the output projection's (``lm_head.``)
    copy, and ``from_pretrained`` ties it to the input embedding."""
    if config.get("tie_word_embeddings") is not True:
        return tensors

    def vocab_sized(key: str) -> bool:
        return tensors[key].dim() == 2 and tensors[key].shape[0] == config.get("vocab_size")

    inputs = [k for k in tensors if vocab_sized(k) and not k.startswith("lm_head.")]
    copies = {
        key
        for key in tensors
        if key.startswith("lm_head.")
        and vocab_sized(key)
        and any(torch.equal(tensors[key], tensors[k]) for k in inputs)
    }
    return {key: tensor for key, tensor in tensors.items() if key not in copies}


def _as_saved(tensors: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """The tensors under the keys ``save_pretrained`` writes for the model of ``config.json``:
    a mixture of experts' stacked experts split per expert again (see
    :mod:`models.hf.conversion`); unchanged without ``transformers`` or a conversion."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return tensors
    try:
        config = AutoConfig.from_pretrained(source)
    except (ValueError, KeyError, OSError):
        return tensors  # a model transformers does not know: its keys stay as they are
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return checkpoint_state(model, tensors)


def _shards(tensors: Mapping[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if shards[-1] and size + _nbytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += _nbytes(tensor)
    return shards


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()
