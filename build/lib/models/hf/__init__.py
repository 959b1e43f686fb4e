"""Hugging Face causal LMs from a local directory: built on meta and initialized as
``transformers`` does (:mod:`models.hf.loading`), their tensor-parallel plans
(:mod:`models.hf.tensor_parallel`), the per-expert conversion of their files
(:mod:`models.hf.conversion`), and the export of a run as a Hugging Face directory
(:mod:`models.hf.export`)."""

from __future__ import annotations

from models.hf.conversion import ConversionError, ConvertedCheckpoint, checkpoint_state
from models.hf.export import HF_FILES_DIR, PEFT_FILES_DIR, write_hf_directory, write_hf_files
from models.hf.loading import hf_init_fn, hf_model
from models.hf.tensor_parallel import hf_tensor_parallel_plan

__all__ = [
    "HF_FILES_DIR",
    "PEFT_FILES_DIR",
    "ConversionError",
    "ConvertedCheckpoint",
    "checkpoint_state",
    "hf_init_fn",
    "hf_model",
    "hf_tensor_parallel_plan",
    "write_hf_directory",
    "write_hf_files",
]
