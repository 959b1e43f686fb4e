"""Expert parallelism on 2 ranks, for tests/models/moe/test_experts.py: run as the check
``expert_parallel`` of ``two_rank_checks.py`` (or alone: ``expert_parallel.py OUT``).

1. The dispatch alone, on routings chosen to be hard: rank 0 sends every token to one expert
   (held by the other rank) and rank 1 uses two experts, so one expert receives no token. Each
   rank writes how far its outputs and the experts' gradients are from one process computing
   every token with all experts (``dispatch``).
2. ``recipes.lm`` on a tiny Qwen3-MoE in the layouts of :data:`RUNS` (:data:`RUNS_OF_4` on 4
   ranks), each under ``OUT/runs/NAME``, to compare with the run without EP; and runs resumed at
   another EP size (:data:`RESUMES`).
3. The refusals: an EP size that does not divide the DP size, or the experts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from gangs import Gang, GangError, ReduceOperation, setup_parallel_gangs, setup_root_gang
from models.moe import apply_expert_parallel
from recipes.lm import LMConfig, build_trainer
from runtime import TrainerCallback
from runtime.cli.config import load_config
from tests.recipes.families import FAMILY_BY_NAME, make_family_dir, write_train
from tests.sync_detector import HostSyncDetector
from tests.workers.leave import leave
from tests.workers.train_toy import ReferenceNorms

EP_STEPS = 3
RUNS: dict[str, tuple[str, ...]] = {
    "ddp": ("data_parallel=ddp",),
    "ddp_ep2": ("data_parallel=ddp", "gang.ep_size=2"),
    "fsdp_ep2": ("data_parallel=fsdp", "gang.ep_size=2"),
}
"""On 2 ranks; on 4, EP=2 leaves each expert on 2 ranks (its replicas): DDP sums their
gradients, FSDP2 shards them over the replicas."""
RUNS_OF_4 = {
    **RUNS,
    "fsdp_ep4": ("data_parallel=fsdp", "gang.ep_size=4"),
    "hsdp_ep2": ("data_parallel=hsdp", "gang.dp_shard_size=2", "gang.ep_size=2"),
    "fsdp_tp2": ("data_parallel=fsdp", "gang.tp_size=2"),
    "fsdp_tp2_ep2": ("data_parallel=fsdp", "gang.tp_size=2", "gang.ep_size=2"),
}
"""``fsdp_ep4`` splits the experts over all 4 ranks; ``hsdp_ep2`` shards the dense layers within
pairs of ranks and the experts over their replicas; under TP the experts stay whole on each TP
rank (``fsdp_tp2``) or split over the 2 DP ranks (``fsdp_tp2_ep2``). A run's ``placements`` in
the report: how its first experts are laid out."""
"""float32 throughout, so that EP must match the run without it within 1e-5."""
RESUMES = {"ep2_from_ddp": ("ddp_ep2", "ddp"), "ddp_from_ep2": ("ddp", "ddp_ep2")}
"""A run in the layout of the first name, resumed (``reshard_on_resume``) from the last
checkpoint of the second, for one more step."""
RESUMES_OF_4 = {**RESUMES, "fsdp_ep2_from_ddp": ("fsdp_ep2", "ddp")}
"""On 4 ranks, also into experts sharded over both their EP gang and their replicas."""
GPT_OSS_RUNS = {"gpt_oss_ddp": RUNS["ddp"], "gpt_oss_fsdp_ep2": RUNS["fsdp_ep2"]}
"""On 4 ranks, gpt-oss's experts (biases, an interleaved gate) too."""


def run_all(root: Gang, out: Path) -> dict[str, Any]:
    model_dir, train = out / "model", out / "train.jsonl"
    if root.rank == 0:
        make_family_dir(FAMILY_BY_NAME["Qwen3-MoE"], model_dir)
        write_train(train)
    root.barrier()
    report: dict[str, Any] = {
        "dispatch": check_dispatch(root, transformers.AutoConfig.from_pretrained(model_dir)),
        # Experts with biases and an interleaved, clamped gate.
        "dispatch_gpt_oss": check_dispatch(root, FAMILY_BY_NAME["gpt-oss"].config(50)),
    }
    runs = out / "runs"
    report["placements"] = {
        name: train_run(root, run_config(model_dir, train, overrides, EP_STEPS), runs / name)
        for name, overrides in (RUNS if root.size == 2 else RUNS_OF_4).items()
    }
    for name, (layout, source) in (RESUMES if root.size == 2 else RESUMES_OF_4).items():
        config = run_config(model_dir, train, RUNS[layout], EP_STEPS + 1)
        config.trainer.reshard_on_resume = True
        train_run(root, config, runs / name, runs / source / "checkpoints" / f"step_{EP_STEPS}")
    if root.size == 4:
        gpt_oss_dir = out / "gpt_oss"
        if root.rank == 0:
            make_family_dir(FAMILY_BY_NAME["gpt-oss"], gpt_oss_dir)
        root.barrier()
        for name, overrides in GPT_OSS_RUNS.items():
            train_run(root, run_config(gpt_oss_dir, train, overrides, EP_STEPS), runs / name)
    report["refusals"] = refusals(root, model_dir)
    if root.size == 2:
        aux_loss_gradients(root, out)
    return report


AUX_LOSS_COEFFICIENT = 1.0
"""Large, so that the load-balancing loss's share of the gradients stands out."""


def aux_loss_gradients(root: Gang, out: Path) -> None:
    """The Trainer's gradients of one DDP step of 2 ranks with one micro-batch a rank (see
    ``test_the_aux_loss_is_normalized_like_the_main_loss_across_dp``), saved by rank 0."""
    from tests.models.moe.test_experts import aux_loss_micro_batches, trainer_gradients

    gangs = setup_parallel_gangs(root)
    grads = trainer_gradients(out, AUX_LOSS_COEFFICIENT, aux_loss_micro_batches(), gangs)
    if root.rank == 0:
        torch.save(grads, out / "aux_loss_grads.pt")


def dp_size(overrides: tuple[str, ...]) -> int:
    tp_size = next((int(o.split("=")[1]) for o in overrides if o.startswith("gang.tp_size=")), 1)
    return int(os.environ.get("WORLD_SIZE", "1")) // tp_size


def run_config(model_dir: Path, train: Path, overrides: tuple[str, ...], steps: int) -> LMConfig:
    """Every layout reads the same 8 sequences a step."""
    return load_config(
        LMConfig,
        overrides=[
            f"model.hf_path={model_dir}",
            f"data.train={train}",
            "data.seq_len=32",
            f"data.batch_size={8 // dp_size(overrides)}",
            "data.num_workers=0",
            "optimizer.lr=0.01",
            "optimizer.warmup_steps=1",
            f"trainer.max_num_steps={steps}",
            f"trainer.checkpoint_every_n_steps={EP_STEPS}",
            "trainer.publish_metrics_every_n_steps=1",
            "trainer.max_gradient_norm=0.5",
            *overrides,
        ],
    )


class _ExpertLayout(TrainerCallback):
    """How the first experts' weight is laid out: its mesh dims, placements and local shape."""

    def __init__(self) -> None:
        self.layout: dict[str, Any] = {}

    def on_before_optimizer_step(self, *, step_nr: int, model: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        param = next(p for n, p in model.named_parameters() if "experts." in n)
        if isinstance(param, DTensor):
            self.layout = {
                "mesh": list(param.device_mesh.mesh_dim_names or ()),
                "placements": [
                    f"{type(p).__name__}({getattr(p, 'dim', '')})" for p in param.placements
                ],
                "local_shape": list(param.to_local().shape),
            }


def train_run(
    root: Gang, config: LMConfig, out: Path, resume_from: Path | None = None
) -> dict[str, Any]:
    gangs = setup_parallel_gangs(
        root,
        tp_size=config.gang.tp_size,
        dp_shard_size=config.gang.dp_shard_size,
        ep_size=config.gang.ep_size,
    )
    trainer = build_trainer(config, out, gangs)
    probe = _ExpertLayout()
    trainer.add_callback(probe)
    # The float64 norm of each step's (clipped) gradients, to hold the published norm to.
    trainer.add_callback(ReferenceNorms(root.rank, out))
    trainer.resume_from = resume_from
    trainer.run()
    trainer.close()
    return probe.layout


def check_dispatch(root: Gang, config: Any) -> dict[str, Any]:
    """EP outputs and gradients against every expert on one rank, for hard routings."""
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp.experts
    with torch.device("meta"):
        sharded = transformers.AutoModelForCausalLM.from_config(config)
    gangs = setup_parallel_gangs(root, ep_size=2)
    apply_expert_parallel(sharded, gangs)
    experts = sharded.model.layers[0].mlp.experts
    experts.to_empty(device="cpu")
    names = [name for name, _ in reference.named_parameters()]
    with torch.no_grad():
        for name in names:
            getattr(experts, name).to_local().copy_(
                getattr(reference, name).chunk(2)[gangs.ep.rank]
            )

    generator = torch.Generator().manual_seed(root.rank)
    tokens = 5 + 2 * root.rank  # uneven: 5, 7, ...
    hidden = torch.randn(tokens, config.hidden_size, generator=generator)
    # EP rank 0: every token to expert 3 (twice over, top-2 of one); EP rank 1: experts 0 and 1
    # only, so expert 2 receives nothing.
    index = torch.full((tokens, 2), 3) if gangs.ep.rank == 0 else torch.tensor([[0, 1]] * tokens)
    weights = torch.rand(tokens, 2, generator=generator)
    with HostSyncDetector() as detector:
        out = experts(hidden.clone().requires_grad_(), index, weights)
        out.square().sum().backward()

    # The reference's gradients add over every rank, as EP's do over the EP gang and the
    # experts' replicas (the 1 / DP size of the Trainer's normalization undone).
    expected = reference(hidden, index, weights)
    (expected.square().sum()).backward()
    report: dict[str, Any] = {"output": float((out - expected).detach().abs().max())}
    report["syncs"] = detector.syncs
    for name in names:
        grad = getattr(experts, name).grad.to_local() * gangs.dp.size
        whole = getattr(reference, name).grad.clone()
        root.all_reduce(whole, ReduceOperation.SUM)
        report[name] = float((grad - whole.chunk(2)[gangs.ep.rank]).abs().max())
        report[f"{name}_received"] = float(whole.chunk(2)[gangs.ep.rank].abs().sum())
    return report


def refusals(root: Gang, model_dir: Path) -> dict[str, str]:
    found = {}
    try:
        setup_parallel_gangs(root, ep_size=3)
    except GangError as ex:
        found["ep_size"] = str(ex)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.num_experts = 3
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        apply_expert_parallel(model, setup_parallel_gangs(root, ep_size=2))
    except ValueError as ex:
        found["experts"] = str(ex)
    return found


if __name__ == "__main__":
    output = Path(sys.argv[1])
    root_gang = setup_root_gang()
    result = run_all(root_gang, output)
    (output / f"rank_{root_gang.rank}.json").write_text(json.dumps(result))
    leave(root_gang)
