"""LoRA adapters (peft) on a model built on meta, and the exports of a LoRA run."""

from __future__ import annotations

from models.lora.adapters import LoraAdapters, LoraSection, apply_lora

__all__ = ["LoraAdapters", "LoraSection", "apply_lora"]
