"""A Hugging Face causal LM from a local directory, built on the meta device so that
``runtime.parallelize_model`` shards it before any weight is allocated, and initialized as
``transformers`` initializes it."""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from models.hf.tensor_parallel import hf_tensor_parallel_plan
from trainkit_utils.modules import InitFn


def hf_model(
    path: Path, *, tp: bool = False
) -> tuple[nn.Module, InitFn, dict[str, ParallelStyle], dict[str, Any]]:
    """The causal LM of the Hugging Face directory ``path``, built on the meta device: the
    model, its init function (for ``runtime.parallelize_model``), its tensor-parallel plan (with
    ``tp``; empty without) and its ``config.json``. The weights are loaded by the Trainer's
    ``init_from`` (or :func:`runtime.load_initial_weights`), converted as
    :mod:`models.hf.conversion` says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config_object = AutoConfig.from_pretrained(path)
    # Training keeps no key/value cache: activation checkpointing's recomputation would append
    # to it a second time (a sliding-window cache then outgrows its mask).
    hf_config_object.use_cache = False
    with torch.device("meta"):
        # transformers picks SDPA where the model supports it, eager attention otherwise (Gemma 2's
        # soft-capped attention logits).
        model = AutoModelForCausalLM.from_config(hf_config_object)  # type: ignore[no-untyped-call,unused-ignore]

    plan = hf_tensor_parallel_plan(model, hf_config_object) if tp else {}
    return model, hf_init_fn(model), plan, json.loads((path / "config.json").read_text())


def hf_init_fn(model: Any) -> InitFn:
    """A module initialized as ``transformers`` initializes it: its own ``_init_weights``, then its
    ancestors' (children first, as ``initialize_weights`` goes), since a parent may set its
    children's tensors (GPT-2 scales its residual projections by depth)."""
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}

    def init_fn(name: str, module: nn.Module) -> None:
        model._init_weights(module)
        ancestors, node = [], module
        while id(node) in parents:
            node = parents[id(node)]
            ancestors.append(node)
        # The ancestors must set only this module's tensors: every other one is marked
        # initialized for them, as transformers marks the weights it loaded.
        own = {id(t) for t in chain(module.parameters(recurse=False), module.buffers(False))}
        marked = [
            t
            for t in chain(model.parameters(), model.buffers())
            if id(t) not in own and not getattr(t, "_is_hf_initialized", False)
        ]
        for tensor in marked:
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]
        try:
            for ancestor in ancestors:
                model._init_weights(ancestor)
        finally:
            for tensor in marked:
                del tensor._is_hf_initialized  # type: ignore[attr-defined]

    return init_fn
