"""Tied weights whose holders are pipeline stages on different ranks: input and output
embeddings tied, with the first stage on one rank and the last on another (``gpipe``, ``1f1b``,
``interleaved_1f1b``; the V-shaped schedules put both on one rank, which keeps one parameter).

Each of the two ranks holds a copy (``model.embed_tokens.weight`` on the first stage's,
``lm_head.weight`` on the last's), as Megatron's embedding group does. The copies stay equal:

- before the pipeline first runs, the first stage's rank broadcasts its copy (materialized from
  the seed under the first holder's name, as one process initializes the tie, or loaded by
  ``init_from`` or a resume) to the last stage's rank;
- after the backward of each step, one all-reduce sums the two gradients, so both copies hold
  the whole model's gradient of the tie, and equal updates keep them equal;
- the gradient norm counts the tie once: on the last stage's rank the copy is left out of it.

The two ranks of each tie group have the same DP and TP coordinate; sharded copies (FSDP2, TP)
must be laid out alike, so that the local shards sum element by element.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch
from torch import Tensor
from torch.nn import Module, Parameter

from gangs import Gang, Gangs, ReduceOperation
from trainkit_utils.modules import split_ties, unwrap_model


@final
class StageTies:
    """This rank's copies of the weights that the first and the last pipeline stages each hold
    (see the module docstring), and the gang of the two ranks that hold them.

    Every rank of the pipeline constructs it (the gangs are made collectively); a rank that
    holds neither stage, or holds both, has no copies and takes part in nothing after.
    """

    def __init__(self, *, part: Module, gangs: Gangs, last_stage_rank: int) -> None:
        self._copies: list[Parameter] = []
        self._gang: Gang | None = None
        self._synced = False
        pp = gangs.pp
        ties = split_ties(part)
        self._is_last = pp.rank == last_stage_rank
        if not ties or last_stage_rank == 0:
            return
        params = dict(unwrap_model(part).named_parameters(remove_duplicate=False))
        for names in ties:
            held = {id(params[n]): params[n] for n in names if n in params}
            if held and pp.rank not in (0, last_stage_rank):
                raise ValueError(
                    f"The model ties {', '.join(names)}, which PP rank {pp.rank} holds in part; "
                    "only a tie between the first and the last stage (tied embeddings) splits "
                    "over pipeline ranks. Untie the weights or use gang.pp_size=1."
                )
            self._copies.extend(held.values())
        self._gang = _tie_gang(gangs, last_stage_rank)
        if self._gang is not None:
            _check_layouts(self._gang, self._copies, ties)

    @property
    def uncounted(self) -> list[Parameter]:
        """The copies the gradient norm leaves out on this rank: the last stage's, so that the
        norm counts each tie once."""
        return list(self._copies) if self._is_last else []

    def sync_weights(self) -> None:
        """Give the last stage's copies the first stage's values, once, before the first run
        (after whatever the Trainer loaded); later calls do nothing."""
        if self._synced:
            return
        self._synced = True
        if self._gang is None:
            return
        with torch.no_grad():
            for copy in self._copies:
                self._gang.broadcast(_local(copy), source_rank=0)

    def sum_gradients(self) -> None:
        """Sum the copies' gradients over the two ranks (one all-reduce each), once a step after
        its last backward: each copy then holds the tie's gradient in the whole model."""
        if self._gang is None:
            return
        for copy in self._copies:
            if copy.grad is not None:
                self._gang.all_reduce(_local(copy.grad), ReduceOperation.SUM)


def _tie_gang(gangs: Gangs, last_stage_rank: int) -> Gang | None:
    """The gang of this rank's first and last stage ranks (the PP gang itself at pp_size 2), or
    None on the ranks between. Every rank makes every group: new_group is collective."""
    pp = gangs.pp
    if pp.size == 2:
        return pp
    stride = gangs.root.size // pp.size
    mine = None
    for offset in range(stride):
        gang = gangs.root.make_gang([offset, last_stage_rank * stride + offset])
        if gang is not None:
            mine = gang
    return mine


def _check_layouts(gang: Gang, copies: Sequence[Parameter], ties: Sequence[Sequence[str]]) -> None:
    """Refuse, in one line, copies that the two ranks shard differently (their local shards would
    not sum element by element): once, at setup."""
    layouts = [_layout(copy) for copy in copies]
    first, last = gang.all_gather_objects(layouts)
    if first != last:
        raise ValueError(
            f"The tied weights {', '.join(n for names in ties for n in names)} are laid out as "
            f"{first} on the first pipeline stage and {last} on the last, which must match to "
            "stay tied: give both modules the same tensor-parallel style, or leave both out "
            "of the plan."
        )


def _layout(tensor: Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return f"{tuple(tensor.shape)} placed {tensor.placements}"
    return f"{tuple(tensor.shape)} whole"


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard (sharing its storage, so that a
    collective on it in place changes the DTensor), else the tensor itself, detached."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.detach()
