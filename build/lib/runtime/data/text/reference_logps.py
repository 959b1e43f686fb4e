"""Reference log-probabilities computed once before a DPO run (``preference.precompute_reference``).

One pass of the reference over each dataset (train, and valid if any) gives every pair's
chosen and rejected log-probabilities; the steps then look them up by the batch's ``pair_ids``
(:class:`units.reference.PrecomputedReference`) and run no reference forward, and the reference
model is freed.

The pass runs on every rank: each DP rank takes the pairs ``i = dp_rank (mod dp_size)``, all
ranks make the same number of forwards (a rank short of pairs repeats one), so the collectives
of FSDP2, HSDP and TP stay in step, and the DP gang gathers the values. It runs in the Trainer's
precision (the reference's own FSDP2 dtypes, and its autocast).

The values are stored with the run, ``OUTPUT_DIR/reference_logps/NAME.pt``, with a fingerprint
of the pairs' tokens and of the reference's source: a resumed run loads them instead of
computing them again; a file made for other pairs or another reference is computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import Tensor

from gangs import Gangs
from runtime.data.device import move_to_device
from runtime.data.text.preference import PreferenceDataset, collate_preference_pairs
from units.reference import ModelReference, PrecomputedReference

log = logging.getLogger(__name__)

Autocast = Callable[[], AbstractContextManager[object]]


def autocast_of(device: torch.device, dtype: torch.dtype, amp: bool) -> Autocast:
    """The Trainer's autocast for ``dtype`` and ``amp``, as a context factory."""
    if not amp or dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def compute_reference_logps(
    reference: ModelReference,
    dataset: PreferenceDataset,
    *,
    gangs: Gangs,
    batch_size: int,
    pad_id: int,
    autocast: Autocast = contextlib.nullcontext,
) -> Tensor:
    """Every pair's reference log-probabilities, ``[len(dataset), 2]`` on the CPU; every rank
    calls it and gets the whole table."""
    dp = gangs.dp
    num_pairs = len(dataset)
    mine = list(range(dp.rank, num_pairs, dp.size))
    per_rank = math.ceil(num_pairs / dp.size)
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    values = []
    for start in range(0, per_rank, batch_size):
        pairs = [dataset[i] for i in padded[start : start + batch_size]]
        batch = move_to_device(collate_preference_pairs(pairs, pad_id=pad_id), gangs.root.device)
        with torch.no_grad(), autocast():
            chosen, rejected = reference.logps(batch).float().chunk(2)
        values.append(torch.stack([chosen, rejected], dim=1))
    local = torch.cat(values)
    gathered = local.new_empty((dp.size, *local.shape))
    dp.all_gather(gathered, local)
    gathered = gathered.cpu()
    table = torch.empty((num_pairs, 2))
    for rank in range(dp.size):
        ids = list(range(rank, num_pairs, dp.size))
        table[ids] = gathered[rank, : len(ids)]
    return table


def stored_reference_logps(
    path: Path,
    dataset: PreferenceDataset,
    *,
    source: str,
    gangs: Gangs,
    compute: Callable[[], Tensor],
) -> PrecomputedReference:
    """The values stored at ``path`` if they were made for ``dataset`` and ``source`` on every
    rank, else ``compute()`` (every rank), written there by rank 0."""
    fingerprint = hashlib.sha256(f"{dataset.fingerprint()}|{source}".encode()).hexdigest()
    table = None
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("fingerprint") == fingerprint:
            table = saved["logps"]
    # Every rank computes, or none: the pass makes collectives.
    if all(gangs.root.all_gather_objects(table is not None)):
        assert table is not None
        log.info("Reference log-probabilities of %d pairs loaded from %s.", len(table), path)
        return PrecomputedReference(table)
    if path.is_file():
        log.warning("%s was made for other pairs or another reference: computing again.", path)
    table = compute()
    if gangs.root.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save({"fingerprint": fingerprint, "logps": table}, partial)
        partial.replace(path)
    log.info("Reference log-probabilities of %d pairs computed, stored in %s.", len(table), path)
    return PrecomputedReference(table)
