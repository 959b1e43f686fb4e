"""Pipeline-parallel runs of a tiny Llama in one ``torchrun`` launch, for tests/runtime/parallel/
test_pipeline.py.

Usage: ``torchrun --nproc-per-node 2 tests/workers/pipeline_checks.py OUT [two [ONE_RUN]]``
(or ``--nproc-per-node 4 ... OUT four``); ``ONE_RUN``, a one-process run of :func:`train`, is
resumed from its step 2 at PP=2 too, and so is the run ``tied`` beside it (the model with tied
embeddings), and (``two`` only) the PP=2 run ``resume``. Each run
of :data:`RUNS` (:data:`FOUR_PROCESS_RUNS`) trains under ``pp_size=2`` into ``OUT/NAME``
(metrics, checkpoints), and the first DP and TP rank of each stage saves its part's whole
weights to ``OUT/NAME/part_{pp_rank}.pt``. ``four`` also runs :data:`SYNC_COUNT_RUNS`, which
count each rank's DP gradient syncs (:func:`count_gradient_syncs`), and tries DDP under ZBV,
whose one-line refusal each rank writes to ``OUT/zbv_ddp_{rank}.txt``. :func:`train` is also the
one-process reference the tests compare with (``pp_size`` 1; :data:`REFERENCES`).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from checkpoint import CheckpointManager
from gangs import Gangs, setup_parallel_gangs, setup_root_gang
from models.llama import DecoderLayer, Llama, LlamaArgs, tensor_parallel_plan
from models.pipeline import split_model
from runtime import MapDataReader, Trainer, load_initial_weights, parallelize_model
from runtime.parallel.pipeline import (
    Pipeline,
    data_parallel_stage,
    schedule_available,
    stage_ids,
)
from tests.sync_detector import LAST, SyncWindow
from tests.workers.leave import leave
from units.lm import LMEvalUnit, LMTrainUnit

ARGS = LlamaArgs(
    vocab_size=32, dim=16, num_layers=4, num_heads=2, num_kv_heads=2, ffn_dim=32, max_seq_len=8
)
SEQ_LEN = 8

TIED: dict[str, Any] = {"tied": True, "lr": 0.005}
"""The options of the runs of a model whose input and output embeddings are one weight."""

RUNS: dict[str, dict[str, Any]] = {
    # Gradient accumulation (2 micro-batches a step, each split into pipeline microbatches),
    # clipping that bites, and a valid set of 18 examples: one process reads 4 batches of 4 and
    # one of 2 (the pipeline infers its shapes again, or pads it), two DP ranks batches of 2
    # and a last one of 1 (padded).
    # The valid set's last batch of 2 is padded to the 4 microbatches.
    "1f1b": {"schedule": "1f1b", "num_microbatches": 4},
    "interleaved_1f1b": {
        "schedule": "interleaved_1f1b",
        "stages_per_rank": 2,
        "num_microbatches": 2,
    },
    "gpipe": {"schedule": "gpipe", "num_microbatches": 2},
    # The V-shaped schedules validate through the stages' forward-only run too.
    "zbv": {"schedule": "zbv", "stages_per_rank": 2, "num_microbatches": 4},
    "dualpipev": {"schedule": "dualpipev", "stages_per_rank": 2, "num_microbatches": 4},
    # Tied input and output embeddings with the first and the last stage on different ranks:
    # each holds a copy, which the pipeline keeps equal. AdamW divides each gradient by its own
    # size, so a gradient near zero turns the float32 rounding of the microbatches' sums into
    # up to lr x 1e-3 of its update: at lr 0.01 one weight of this model drifts 1.07e-5 from one
    # process in four steps (the tie itself 5e-7), at TIED["lr"] half that.
    "tied_1f1b": {"schedule": "1f1b", "num_microbatches": 4, **TIED},
    "tied_interleaved_1f1b": {
        "schedule": "interleaved_1f1b",
        "stages_per_rank": 2,
        "num_microbatches": 2,
        **TIED,
    },
    # Saved at step 2 (of 4) for the resume at pp_size 1.
    "tied_resume": {"schedule": "1f1b", "num_microbatches": 2, "max_num_steps": 2, **TIED},
    # No host sync in the steady steps (tests/sync_detector.py): steps 4 to 7, nothing due.
    # With tied embeddings: the all-reduce of the tie's gradients reads nothing either.
    "host_sync": {
        "schedule": "1f1b",
        "num_microbatches": 2,
        "valid": False,
        "host_sync": True,
        "tied": True,
    },
    # Saved at step 2 (of 4) for the resume at pp_size 1.
    "resume": {"schedule": "1f1b", "num_microbatches": 2, "max_num_steps": 2},
}
NUM_STEPS = 4

REFERENCES: dict[str, dict[str, Any]] = {
    "valid": {},
    "no_valid": {"valid": False},
    "tied": TIED,
    "batch_8": {"batch_size": 8},
    "batch_8_no_accumulation": {"batch_size": 8, "num_accumulate": 1},
}
"""The one-process runs of :func:`train` that the tests compare the runs with: a run's
``reference`` names its own, else it is ``tied``, ``valid`` or ``no_valid`` by its options."""

V_SHAPED_FSDP: dict[str, Any] = {
    "stages_per_rank": 2,
    "num_microbatches": 4,
    "kind": "fsdp",
    "batch_size": 4,
    "reference": "batch_8",
}
"""The options of the four-process runs of a V-shaped schedule over two DP ranks a stage."""

FOUR_PROCESS_RUNS: dict[str, dict[str, Any]] = {
    # pp outermost: ranks 0-1 are stage 0 (a DP or TP pair), ranks 2-3 stage 1.
    "pp2_fsdp2": {"schedule": "1f1b", "num_microbatches": 2, "kind": "fsdp", "batch_size": 2},
    # DDP around each stage, the part unwrapped; looped stages each their own DDP.
    "pp2_ddp": {"schedule": "1f1b", "num_microbatches": 2, "kind": "ddp", "batch_size": 2},
    "pp2_ddp_interleaved": {"schedule": "interleaved_1f1b", "stages_per_rank": 2,
                            "num_microbatches": 2, "kind": "ddp", "batch_size": 2},
    "pp2_tp2": {"schedule": "interleaved_1f1b", "stages_per_rank": 2, "num_microbatches": 2,
                "tp_size": 2},
    # Tied embeddings over FSDP2: each stage's copy sharded alike, the local shards summed;
    # over TP: the layers' plan leaves both copies whole on each TP rank.
    "pp2_fsdp2_tied": {"schedule": "1f1b", "num_microbatches": 2, "kind": "fsdp",
                       "batch_size": 2, **TIED},
    "pp2_tp2_tied": {"schedule": "1f1b", "num_microbatches": 2, "tp_size": 2, **TIED},
    # PP=4: the first and the last stage's ranks sum the tie's gradients in a group of their own.
    "pp4_tied": {"schedule": "1f1b", "num_microbatches": 4, "pp_size": 4, **TIED},
    # The V-shaped schedules split the backward into input and weight gradients: over FSDP2,
    # HSDP (2 replicas of one shard) and TP. Their 4 microbatches need batches of 4 a DP rank,
    # so the FSDP2 and HSDP runs equal one process reading batches of 8 ("reference").
    "pp2_fsdp2_zbv": {**V_SHAPED_FSDP, "schedule": "zbv"},
    "pp2_fsdp2_dualpipev": {**V_SHAPED_FSDP, "schedule": "dualpipev"},
    "pp2_fsdp2_dualpipev_no_accumulation": {**V_SHAPED_FSDP, "schedule": "dualpipev",
                                            "num_accumulate": 1,
                                            "reference": "batch_8_no_accumulation"},
    "pp2_hsdp_zbv": {**V_SHAPED_FSDP, "schedule": "zbv", "kind": "hsdp", "dp_shard_size": 1},
    "pp2_tp2_zbv": {"schedule": "zbv", "stages_per_rank": 2, "num_microbatches": 4,
                    "tp_size": 2},
    # The rest of the schedules x layouts matrix: every schedule over FSDP2 and over TP.
    "pp2_fsdp2_gpipe": {"schedule": "gpipe", "num_microbatches": 2, "kind": "fsdp",
                        "batch_size": 2},
    "pp2_fsdp2_interleaved": {"schedule": "interleaved_1f1b", "stages_per_rank": 2,
                              "num_microbatches": 2, "kind": "fsdp", "batch_size": 2},
    "pp2_tp2_gpipe": {"schedule": "gpipe", "num_microbatches": 2, "tp_size": 2},
    "pp2_tp2_1f1b": {"schedule": "1f1b", "num_microbatches": 2, "tp_size": 2},
    "pp2_tp2_dualpipev": {"schedule": "dualpipev", "stages_per_rank": 2, "num_microbatches": 4,
                          "tp_size": 2},
    # Every schedule over HSDP (2 replicas of one shard), and tied embeddings under gpipe.
    **{f"pp2_hsdp_{schedule}": {"schedule": schedule, "stages_per_rank": stages,
                                "num_microbatches": 2, "kind": "hsdp", "dp_shard_size": 1,
                                "batch_size": 2}
       for schedule, stages in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))},
    "pp2_hsdp_dualpipev": {**V_SHAPED_FSDP, "schedule": "dualpipev", "kind": "hsdp",
                           "dp_shard_size": 1},
    "pp2_fsdp2_tied_gpipe": {"schedule": "gpipe", "num_microbatches": 2, "kind": "fsdp",
                             "batch_size": 2, **TIED},
}  # fmt: skip
"""Runs of ``pipeline_checks.py OUT four`` on four processes (the slow tests)."""

SYNC_COUNT_RUNS: dict[str, dict[str, Any]] = {
    f"syncs_{kind}_{accumulate}": {"schedule": "1f1b", "num_microbatches": 2, "kind": kind,
                                   "batch_size": 2, "num_accumulate": accumulate,
                                   "valid": False, "count_syncs": True, "max_num_steps": 2}
    for kind in ("ddp", "fsdp")
    for accumulate in (1, 4)
}  # fmt: skip
"""Runs of ``pipeline_checks.py OUT four`` that count the DP gradient syncs of each step
(``grad_syncs_{rank}.json``: per step, over two steps), with 1 and 4 micro-batches a step."""

EIGHT_PROCESS_RUNS: dict[str, dict[str, Any]] = {
    "pp2_fsdp2_tp2": {"schedule": "1f1b", "num_microbatches": 2, "kind": "fsdp", "batch_size": 2,
                      "tp_size": 2},
    # Every other schedule over the same layout.
    "pp2_fsdp2_tp2_gpipe": {"schedule": "gpipe", "num_microbatches": 2, "kind": "fsdp",
                            "batch_size": 2, "tp_size": 2},
    "pp2_fsdp2_tp2_interleaved": {"schedule": "interleaved_1f1b", "stages_per_rank": 2,
                                  "num_microbatches": 2, "kind": "fsdp", "batch_size": 2,
                                  "tp_size": 2},
    "pp2_fsdp2_tp2_zbv": {**V_SHAPED_FSDP, "schedule": "zbv", "tp_size": 2},
    "pp2_fsdp2_tp2_dualpipev": {**V_SHAPED_FSDP, "schedule": "dualpipev", "tp_size": 2},
}  # fmt: skip
"""Runs of ``pipeline_checks.py OUT eight`` on eight processes (slow)."""


@dataclass
class Batch:
    input_ids: Tensor
    target_ids: Tensor
    num_targets: int

    @property
    def batch_size(self) -> int:
        return self.input_ids.size(0)


class Tokens(torch.utils.data.Dataset[Tensor]):
    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, ARGS.vocab_size, (size, SEQ_LEN + 1), generator=gen)
        # Every third example has its last half masked out, so batches differ in targets.
        self.tokens[::3, SEQ_LEN // 2 + 1 :] = -100

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Tensor:
        return self.tokens[index]


def collate(examples: list[Tensor]) -> Batch:
    tokens = torch.stack(examples)
    inputs = tokens[:, :-1].clamp(min=0)
    targets = tokens[:, 1:]
    return Batch(inputs, targets, int((targets != -100).sum()))


def whole_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(ARGS)
    return model


def train(
    gangs: Gangs,
    output_dir: Path,
    options: dict[str, Any],
    *,
    resume_from: Path | None = None,
    max_num_steps: int | None = None,
) -> dict[str, Tensor]:
    """One run; returns this rank's weights, whole (its part's under pipeline parallelism).

    The model is built on meta and materialized from the seed (each weight from its name), so
    every layout starts from the same weights."""
    with torch.device("meta"):
        whole = Llama(ARGS)
    if options.get("tied", False):
        whole.lm_head.weight = whole.model.embed_tokens.weight
    model: nn.Module = whole
    pipeline, stages = None, []
    if gangs.pp.size > 1:
        schedule = options["schedule"]
        per_rank = options.get("stages_per_rank", 1)
        ids = stage_ids(
            schedule, pp_rank=gangs.pp.rank, pp_size=gangs.pp.size, stages_per_rank=per_rank
        )
        stages, model = split_model(whole, ids, gangs.pp.size * per_rank)
    model = parallelize_model(
        model,
        gangs,
        kind=options.get("kind", "ddp"),
        block_types=(DecoderLayer,),
        seed=2,
        tp_plan=_tp_plan(whole, gangs, shard_head=options.get("shard_head", False)),
        init_fn=whole.init_module,
        pipeline_stages=stages,
    )
    if gangs.pp.size > 1:
        pipeline = Pipeline(
            stages=stages,
            part=model,
            ids=ids,
            gangs=gangs,
            schedule=schedule,
            num_microbatches=options["num_microbatches"],
        )
    batch_size = options.get("batch_size", 4)
    reader = MapDataReader(
        dataset=Tokens(24, seed=1),
        batch_size=batch_size,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=options.get("num_accumulate", 2),
        seed=3,
    )
    valid = options.get("valid", True)
    valid_reader = MapDataReader(
        dataset=Tokens(18, seed=2), batch_size=batch_size, collate=collate, gang=gangs.dp, seed=3
    )
    watch = options.get("host_sync", False)
    window = SyncWindow() if watch else None
    trainer = Trainer(
        unit=LMTrainUnit(model),
        data_reader=reader,
        # SGD where host syncs are watched: AdamW reads its step count on the host.
        optimizer=(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            if watch
            else torch.optim.AdamW(model.parameters(), lr=options.get("lr", 0.01))
        ),
        checkpoint_manager=CheckpointManager(output_dir / "checkpoints", gangs),
        gangs=gangs,
        valid_units=[LMEvalUnit(model)] if valid else None,
        valid_data_readers=[valid_reader] if valid else None,
        validate_every_n_steps=2 if valid else None,
        max_num_steps=max_num_steps
        or options.get("max_num_steps", LAST + 1 if watch else NUM_STEPS),
        max_gradient_norm=0.5,
        publish_metrics_every_n_steps=100 if watch else 1,
        metrics_dir=output_dir / "metrics",
        checkpoint_every_n_steps=None if watch else 2,
        callbacks=[] if window is None else [window],
        reshard_on_resume=resume_from is not None,
        resume_from=resume_from,
        progress=False,
        pipeline=pipeline,
    )
    counting = options.get("count_syncs", False)
    with count_gradient_syncs(stages if counting else []) as syncs:
        trainer.run()
    if counting:
        per_step = {name: count / trainer.step_nr for name, count in syncs.items()}
        (output_dir / f"grad_syncs_{gangs.root.rank}.json").write_text(json.dumps(per_step))
    if window is not None:
        (output_dir / f"syncs_{gangs.root.rank}.json").write_text(json.dumps(window.detector.syncs))
    # Whole tensors of the sharded ones (a collective within the stage's DP or TP gang).
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in model.state_dict().items()
    }


@contextmanager
def count_gradient_syncs(stages: list[nn.Module]) -> Iterator[Counter[str]]:
    """Count, while in the block, the DP gradient syncs of this rank's stages: FSDP2's
    reduce-scatters (the calls of ``torch.distributed``'s reduce-scatter functions, which only
    FSDP2 makes here) and the all-reduces of each stage's DDP (a comm hook that counts each
    bucket's all-reduce and makes it as DDP does)."""
    counts: Counter[str] = Counter()
    patched = {}
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if stages and hasattr(dist, name):
            patched[name] = getattr(dist, name)
            setattr(dist, name, _counted(patched[name], counts))
    for stage in stages:
        wrapper = data_parallel_stage(stage)
        if isinstance(wrapper, DistributedDataParallel):
            wrapper.register_comm_hook(wrapper.process_group, _counting_allreduce(counts))
    try:
        yield counts
    finally:
        for name, function in patched.items():
            setattr(dist, name, function)


def _counted(function: Callable[..., Any], counts: Counter[str]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter"] += 1
        return function(*args, **kwargs)

    return counted


def _counting_allreduce(counts: Counter[str]) -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> Any:
        counts["all_reduce"] += 1
        return allreduce_hook(group, bucket)

    # DDP checks the annotations themselves, which this module's postponed ones are not.
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": Future[Tensor]}
    return hook


def _tp_plan(whole: Llama, gangs: Gangs, *, shard_head: bool) -> dict[str, Any] | None:
    """The model's TP plan (its layers'); ``shard_head``: the head's vocabulary split too, and
    not the embedding's (a tied pair split differently)."""
    if gangs.tp.size == 1:
        return None
    plan: dict[str, Any] = dict(tensor_parallel_plan(whole))
    if shard_head:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def load_tied_source(gangs: Gangs, output_dir: Path) -> None:
    """Load a file that stores the tied embedding once (``model.embed_tokens.weight``) into each
    rank's part of the tied model under 1F1B, and save the part as loaded (before any run of
    the pipeline, which would broadcast the first stage's copy) to ``tied_init_{rank}.pt``."""
    model = whole_model()
    model.lm_head.weight = model.model.embed_tokens.weight
    source = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = output_dir / f"tied_source_{gangs.root.rank}.pt"
    torch.save(source, path)
    with torch.device("meta"):
        whole = Llama(ARGS)
    whole.lm_head.weight = whole.model.embed_tokens.weight
    _, part = split_model(whole, [gangs.pp.rank], gangs.pp.size)
    part = parallelize_model(
        part, gangs, kind="ddp", block_types=(DecoderLayer,), seed=2, init_fn=whole.init_module
    )
    load_initial_weights(part, path, gangs=gangs)
    torch.save(part.state_dict(), output_dir / f"tied_init_{gangs.root.rank}.pt")


def save_part(gangs: Gangs, run_dir: Path, part: dict[str, Tensor]) -> None:
    """The first DP and TP rank of each stage saves its part as ``part_{pp_rank}.pt``."""
    if gangs.dp.rank == 0 and gangs.tp.rank == 0:
        torch.save(part, run_dir / f"part_{gangs.pp.rank}.pt")


def main(output_dir: Path, which: str, one_process_run: Path | None) -> None:
    """The runs of ``which`` (``two`` or ``four``); with ``one_process_run`` (a run of
    :func:`train` on one process), also ``resume_1_to_2``: its step 2 resumed at PP=2."""
    root = setup_root_gang()
    four = {**FOUR_PROCESS_RUNS, **SYNC_COUNT_RUNS}
    runs = dict({"two": RUNS, "four": four, "eight": EIGHT_PROCESS_RUNS}[which])
    if one_process_run is not None:
        runs["resume_1_to_2"] = {
            "schedule": "1f1b",
            "num_microbatches": 2,
            "resume_from": str(one_process_run / "checkpoints" / "step_2"),
        }
        # The tied model's one-process run beside it: one weight there, a copy on each rank here.
        runs["tied_resume_1_to_2"] = {
            **runs["resume_1_to_2"],
            **TIED,
            "resume_from": str(one_process_run.parent / "tied" / "checkpoints" / "step_2"),
        }
    if which == "two":
        # The PP=2 checkpoint of step 2 resumed at PP=2: each rank's optimizer groups keep
        # their own parameters' names.
        runs["resume_2_to_2"] = {
            "schedule": "1f1b",
            "num_microbatches": 2,
            "resume_from": str(output_dir / "resume" / "checkpoints" / "step_2"),
        }
    for name, options in runs.items():
        if not schedule_available(options["schedule"]):
            continue  # the test skips it too
        run_dir = output_dir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        gangs = setup_parallel_gangs(
            root,
            pp_size=options.get("pp_size", 2),
            tp_size=options.get("tp_size", 1),
            dp_shard_size=options.get("dp_shard_size"),
        )
        resume_from = options.get("resume_from")
        try:
            part = train(gangs, run_dir, options, resume_from=resume_from and Path(resume_from))
        except BaseException as ex:
            ex.add_note(f"(in pipeline_checks.py's run {name})")
            raise
        save_part(gangs, run_dir, part)
        (output_dir / f"gangs_{gangs.root.rank}.json").write_text(
            json.dumps({"repr": repr(gangs), "pp_rank": gangs.pp.rank, "dp": gangs.dp.size})
        )
    if which == "two":
        load_tied_source(gangs, output_dir)
    if which == "four":
        # A TP plan that splits the head but not the embedding it is tied to: refused at
        # start, on every rank alike.
        gangs = setup_parallel_gangs(root, pp_size=2, tp_size=2)
        try:
            train(
                gangs, output_dir / "tied_split_apart", {**runs["pp2_tp2_tied"], "shard_head": True}
            )
        except ValueError as ex:
            (output_dir / f"tied_split_apart_{root.rank}.txt").write_text(str(ex))
    if which == "four" and schedule_available("zbv"):
        # DDP cannot see the weight gradients of a split backward, and FSDP2 would untie the
        # embeddings that rank 0's first and last stages share: both refused at start.
        gangs = setup_parallel_gangs(root, pp_size=2)
        refused = {
            "zbv_ddp": {**RUNS["zbv"], "kind": "ddp", "batch_size": 2},
            "zbv_fsdp_tied": {**V_SHAPED_FSDP, "schedule": "zbv", **TIED},
        }
        for name, options in refused.items():
            try:
                train(gangs, output_dir / name, options)
            except ValueError as ex:
                (output_dir / f"{name}_{root.rank}.txt").write_text(str(ex))
    leave(root)


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        sys.argv[2] if len(sys.argv) > 2 else "two",
        Path(sys.argv[3]) if len(sys.argv) > 3 else None,
    )
