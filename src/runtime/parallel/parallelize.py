"""The steps that turn a model built on ``meta`` into a trainable one, in the one order they
compose in: TP, activation checkpointing, FSDP2/HSDP, materialize, DDP, compile."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch.nn import Module, Parameter

from gangs import Gangs, agree
from runtime.parallel.activation_recompute import apply_activation_checkpointing
from runtime.parallel.compile import compile_blocks
from runtime.parallel.materialize import materialize_model
from runtime.parallel.pipeline import set_data_parallel_stage
from runtime.parallel.wrapping import DataParallelKind, apply_data_parallel, apply_tensor_parallel
from trainkit_utils.modules import InitFn, split_ties

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def parallelize_model(
    model: Module,
    gangs: Gangs,
    *,
    kind: DataParallelKind,
    block_types: tuple[type[Module], ...],
    seed: int,
    tp_plan: Mapping[str, ParallelStyle] | None = None,
    init_fn: InitFn | None = None,
    activation_checkpointing_every_n: int | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    compile: bool = False,
    expert_params: Collection[Parameter] = (),
    pipeline_stages: Sequence[Module] = (),
) -> Module:
    """Shard, wrap and initialize ``model`` (built under ``torch.device("meta")``) for ``gangs``.

    1. ``tp_plan`` shards its submodules over the TP gang (:func:`apply_tensor_parallel`);
    2. every ``activation_checkpointing_every_n``-th block is checkpointed (None: none);
    3. with ``kind`` "fsdp" or "hsdp", each ``block_types`` module becomes an FSDP2 unit, then
       the whole model (:func:`apply_data_parallel`, with ``param_dtype`` and ``reduce_dtype``);
    4. this rank's shards are allocated on ``gangs.root.device`` and initialized from ``seed``
       (:func:`materialize_model`, with ``init_fn``); parameters that several modules share,
       such as tied input and output embeddings, stay one parameter;
    5. with ``kind="ddp"``, DDP wraps the model (each pipeline stage), unless no parameter
       requires a gradient;
    6. with ``compile``, each block is compiled (:func:`compile_blocks`).

    ``expert_params`` (already sharded over the EP gang) are left alone by DDP and FSDP2.

    ``pipeline_stages``: ``model`` is a rank's part of a pipeline (:mod:`models.pipeline`) and
    these are its stages, which share its modules. The TP plan's entries for layers of other
    ranks are left out, and FSDP2 or DDP wraps each stage (whose ``forward`` the pipeline calls)
    rather than the part: the part, which the unit trains and the checkpoints hold, stays
    unwrapped under DDP too (the pipeline finds each stage's wrapper:
    :func:`~runtime.parallel.pipeline.data_parallel_stage`).

    Returns the model to train: the DDP wrapper under DDP (but of a pipeline's part), else
    ``model`` itself.
    """
    if pipeline_stages:
        if kind != "ddp":
            _check_no_weight_shared_by_stages(model, pipeline_stages, gangs)
        names = {name for name, _ in model.named_modules()}
        tp_plan = {name: style for name, style in (tp_plan or {}).items() if name in names}
    model = apply_tensor_parallel(model, gangs, tp_plan or {})
    if activation_checkpointing_every_n is not None:
        apply_activation_checkpointing(
            model, block_types=block_types, every_n=activation_checkpointing_every_n
        )
    if kind != "ddp":
        # FSDP2 shards the meta parameters, so each rank allocates only its shards below.
        for target in pipeline_stages or [model]:
            sharded = apply_data_parallel(
                target,
                gangs,
                kind=kind,
                fsdp_units=block_types,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                expert_params=expert_params,
            )
            assert sharded is target  # fully_shard shards in place

    materialize_model(model, device=gangs.root.device, seed=seed, init_fn=init_fn)
    # A frozen model (a reference to compare against) has no gradient to synchronize: DDP,
    # which would refuse it, leaves it whole on each rank.
    if kind == "ddp" and pipeline_stages:
        _replicate_stages(pipeline_stages, gangs, expert_params)
    elif kind == "ddp" and any(param.requires_grad for param in model.parameters()):
        model = apply_data_parallel(model, gangs, kind="ddp", expert_params=expert_params)
    if compile:
        compile_blocks(model, block_types=block_types)
    return model


def _check_no_weight_shared_by_stages(
    model: Module, stages: Sequence[Module], gangs: Gangs
) -> None:
    """Refuse, in one line on every rank, a weight that two stages of a rank hold (tied
    embeddings under ``zbv`` and ``dualpipev``, which put the first and the last stage on rank
    0): FSDP2 shards each stage apart and would give each its own copy, untied. Only a model
    with ties asks its peers (one all-reduce at setup): other ranks cannot tell alone."""
    if not split_ties(model):
        return
    holders: dict[int, int] = {}
    shares = False
    for index, stage in enumerate(stages):
        for param in stage.parameters():
            shares = shares or holders.setdefault(id(param), index) != index
    if agree(gangs.root, failed=shares)[0]:
        raise ValueError(
            "Two pipeline stages of one rank share a tied weight (the first and the last stage "
            "under zbv or dualpipev), which FSDP2 and HSDP shard per stage and would untie. Use "
            "pipeline.schedule=1f1b or interleaved_1f1b (the first and the last stage's ranks "
            "each keep a copy, kept tied), or data_parallel=ddp over one DP rank a stage."
        )


def _replicate_stages(
    stages: Sequence[Module], gangs: Gangs, expert_params: Collection[Parameter]
) -> None:
    """DDP over the DP gang around each stage that trains a weight, for the pipeline to run
    (:func:`~runtime.parallel.pipeline.set_data_parallel_stage`): torch's pipeline stages drive
    DDP's ``no_sync`` and its last backward themselves. The part stays unwrapped."""
    for stage in stages:
        if not any(param.requires_grad for param in stage.parameters()):
            continue
        wrapper = apply_data_parallel(stage, gangs, kind="ddp", expert_params=expert_params)
        if wrapper is not stage:
            set_data_parallel_stage(stage, wrapper)
