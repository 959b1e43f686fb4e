"""LoRA: peft's low-rank adapters on a Hugging Face model built on meta.

:func:`apply_lora` injects the adapters (``peft.inject_adapter_in_model``: the model stays the
transformers model, so FSDP2, activation checkpointing and export see its own modules) before
TP, FSDP2 and materialization, and freezes every other weight. peft is an optional extra
(``pip install trainkit[lora]``): it is what loads the adapters users ship.

What the checkpoints should hold: the adapters, their optimizer state and the trainer state.
The frozen base (:attr:`LoraAdapters.frozen`) is left out (the Trainer's ``checkpoint_exclude``)
and loaded again from the base weights on resume (``init_from=InitSource(base,
rename=adapters.base_rename, skip=adapters.adapter_patterns)``), so a checkpoint of a LoRA run
is a fraction of a full one. ``python -m runtime export --format peft`` writes the adapters as peft saves them;
``--format hf`` writes the base with the adapters merged in.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn

from models.hf.export import PEFT_FILES_DIR
from trainkit_utils.modules import InitFn

log = logging.getLogger(__name__)

# The name peft gives the one adapter that inject_adapter_in_model adds.
_ADAPTER = "default"


@dataclass
class LoraSection:
    """LoRA through peft (``pip install trainkit[lora]``): low-rank adapters on target_modules,
    every other weight frozen."""

    rank: int | None = None
    """The adapters' rank (None: no LoRA, every weight trains)."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """The linear layers that get adapters: names, or the last parts of qualified names."""


@dataclass(frozen=True)
class LoraAdapters:
    """What :func:`apply_lora` did to a model."""

    adapted: tuple[str, ...]
    """The qualified names of the layers that got adapters."""
    frozen: tuple[str, ...]
    """The names of the frozen parameters: the base model."""
    peft_config: Any
    """peft's ``LoraConfig`` of the adapters."""

    @property
    def base_rename(self) -> dict[str, str]:
        """How the base model's names map onto the adapted model's: peft moves each adapted
        layer's weights under ``base_layer`` (an ``InitSource``'s ``rename``)."""
        return {f"{name}.": f"{name}.base_layer." for name in self.adapted}

    adapter_patterns: ClassVar[tuple[str, ...]] = ("*.lora_A.*", "*.lora_B.*")
    """The adapters' names, which no base weights set (an ``InitSource``'s ``skip``)."""

    def write_adapter_config(self, base: Path, output_dir: Path) -> None:
        """Keep peft's ``adapter_config.json`` under ``OUTPUT_DIR/peft/`` for export; it names
        ``base``, the weights the adapters go with."""
        self.peft_config.base_model_name_or_path = str(base.resolve())
        self.peft_config.save_pretrained(str(output_dir / PEFT_FILES_DIR))


def apply_lora(
    model: nn.Module, section: LoraSection, init_fn: InitFn
) -> tuple[LoraAdapters, InitFn]:
    """Inject LoRA adapters into ``model`` (on meta) and freeze the rest; return what was done
    and the ``init_fn`` for :func:`~runtime.materialize_model` that initializes the adapters as
    peft does and the rest with ``init_fn``."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    if section.rank is None:
        raise ValueError("lora.rank is not set: give the adapters' rank, e.g. lora.rank=8.")
    config = LoraConfig(
        r=section.rank,
        # peft annotates an int, and scales by alpha / r in floating point either way.
        lora_alpha=section.alpha,  # type: ignore[arg-type]
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        with torch.device("meta"):
            inject_adapter_in_model(config, model)
    except ValueError as ex:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"lora.target_modules {section.target_modules} names no layer of "
            f"{type(model).__name__} ({ex}). Its linear layers are named {', '.join(linear)}."
        ) from None
    adapted = tuple(name for name, module in model.named_modules() if isinstance(module, LoraLayer))
    frozen = tuple(name for name, param in model.named_parameters() if not param.requires_grad)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    num_params = sum(p.numel() for p in model.parameters())
    log.info(
        "LoRA of rank %d on %d layers: %d of %d parameters train.",
        section.rank,
        len(adapted),
        num_trainable,
        num_params,
    )

    def init_adapters(name: str, module: nn.Module) -> None:
        # peft's init (init_lora_weights=True): A as nn.Linear's default, B zero, so the
        # adapted model starts as the base model.
        if name.endswith(f".lora_A.{_ADAPTER}"):
            nn.init.kaiming_uniform_(cast(Tensor, module.weight), a=math.sqrt(5))
        elif name.endswith(f".lora_B.{_ADAPTER}"):
            nn.init.zeros_(cast(Tensor, module.weight))
        else:
            init_fn(name, module)

    return LoraAdapters(adapted, frozen, config), init_adapters
