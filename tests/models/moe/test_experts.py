"""Mixtures of experts (``models.moe``, through ``recipes.lm``): the load-balancing loss (on where the config has a
coefficient, the model's own value, weighted like the summed main loss), the FLOPs, the host
syncs, and expert parallelism (``tests/workers/expert_parallel.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointManager
from gangs import Gangs
from models.moe import MoeLMTrainUnit, router_aux_loss_coefficient
from runtime import MapDataReader, Trainer, TrainerCallback, apply_data_parallel, unwrap_model
from runtime.data.text import TextBatch
from tests.conftest import (
    assert_ok,
    assert_published_norms_are_exact,
    rank_reports,
    read_jsonl,
    run_python,
    torchrun,
)
from tests.recipes.families import FAMILY_BY_NAME
from tests.recipes.test_lm import last_model

transformers = pytest.importorskip("transformers")


def family_model(name: str) -> torch.nn.Module:
    """The family's tiny model, built from its config (a vocabulary of 50)."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(FAMILY_BY_NAME[name].config(50))


def batch_of(model: torch.nn.Module, *, rows: int = 3, length: int = 10) -> TextBatch:
    tokens = torch.randint(
        0, model.config.vocab_size, (rows, length + 1), generator=torch.Generator().manual_seed(1)
    )
    return TextBatch(
        input_ids=tokens[:, :-1].contiguous(),
        target_ids=tokens[:, 1:].contiguous(),
        num_targets=rows * length,
    )


def grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_coefficient_is_the_configs_and_zero_without_an_aux_loss() -> None:
    assert router_aux_loss_coefficient(family_model("OLMoE")) == 0.01
    assert router_aux_loss_coefficient(family_model("DeepSeek-V3")) == 0.0
    assert router_aux_loss_coefficient(family_model("Llama")) == 0.0
    assert router_aux_loss_coefficient(torch.nn.Linear(2, 2)) == 0.0


def test_the_units_loss_is_transformers_loss_summed_and_the_aux_loss_has_its_share() -> None:
    """The unit's sum over the targets, divided by them, is the loss transformers computes with
    labels (mean cross entropy + coefficient x load-balancing loss); and the gradient of the
    mean differs from the cross entropy's alone by the coefficient times the aux loss's."""
    model = family_model("OLMoE")
    batch = batch_of(model)
    unit = MoeLMTrainUnit(model)
    coefficient = unit.aux_loss_coefficient
    assert coefficient == 0.01

    loss, num_targets = unit(batch)
    assert num_targets == batch.num_targets
    expected = model(
        input_ids=batch.input_ids,
        labels=batch.target_ids,
        shift_labels=batch.target_ids,
        output_router_logits=True,
    )
    torch.testing.assert_close(loss / num_targets, expected.loss, rtol=1e-6, atol=1e-7)

    with_aux = grads(model, unit(batch)[0] / num_targets)
    unit.aux_loss_coefficient = 0.0
    without_aux = grads(model, unit(batch)[0] / num_targets)
    aux = grads(model, model(input_ids=batch.input_ids, output_router_logits=True).aux_loss)
    routers = [name for name in aux if name.endswith("mlp.gate.weight")]
    assert routers and all(aux[name].abs().sum() > 0 for name in routers)
    for name, value in with_aux.items():
        share = coefficient * aux.get(name, torch.zeros_like(value))
        # float32 gradients of order 1e-2 differ by rounding of order 1e-8.
        torch.testing.assert_close(value - without_aux[name], share, rtol=1e-3, atol=2e-7)
    # The routers' share is far above that rounding: the comparison can fail.
    assert max(float((coefficient * aux[name]).abs().max()) for name in routers) > 1e-5
    assert float(unit.metric_bag.router_aux_loss.compute()) == pytest.approx(
        float(expected.aux_loss.detach()), rel=1e-6
    )


# --------------------------------------------------------------------- expert parallelism

EP_TOLERANCE = 1e-5


@pytest.mark.distributed
def test_expert_parallel_dispatch_is_exact_for_lopsided_and_empty_routings(
    two_rank_checks: Path,
) -> None:
    """One rank sends every token to one expert of the other rank, the other leaves an expert
    without a token: outputs and expert gradients equal one process's with every expert, for
    Qwen3-MoE's experts and gpt-oss's (biases, an interleaved and clamped gate); the forward
    and backward make one host sync."""
    weights = {
        "dispatch": ["gate_up_proj", "down_proj"],
        "dispatch_gpt_oss": ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"],
    }
    for report in rank_reports(two_rank_checks / "expert_parallel", 2):
        for kind, names in weights.items():
            dispatch = report[kind]
            assert dispatch["output"] < EP_TOLERANCE, dispatch
            assert {k for k in dispatch if k.endswith("_received")} == {
                f"{name}_received" for name in names
            }
            for name in names:
                assert dispatch[name] < EP_TOLERANCE, dispatch
                assert dispatch[f"{name}_received"] > 0, dispatch  # the comparison can fail
            # Pinned: one host sync a layer's forward (the split sizes), none in its backward.
            (sync,) = dispatch["syncs"]
            assert sync.startswith("tolist at ") and "models/moe/experts.py" in sync, sync


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["ddp_ep2", "fsdp_ep2"])
def test_expert_parallel_training_equals_the_run_without_it(
    two_rank_checks: Path, run: str
) -> None:
    """recipes.lm on Qwen3-MoE (float32, gradients clipped): each rank holds 2 of the 4
    experts, yet losses, gradient norms and the saved weights (global shapes) equal DDP's."""
    assert_equals_ddp(two_rank_checks / "expert_parallel" / "runs", run)


def assert_equals_ddp(runs: Path, run: str, reference_run: str = "ddp") -> None:
    from tests.workers.expert_parallel import EP_STEPS

    reference, records = (
        last_model(runs / reference_run),
        read_jsonl(runs / run / "metrics" / "train.jsonl"),
    )
    expected = read_jsonl(runs / reference_run / "metrics" / "train.jsonl")
    assert len(records) == EP_STEPS
    for got, want in zip(records, expected, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=EP_TOLERANCE)
        # Clipping at 0.5 bites: the norm counts every expert once.
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], abs=EP_TOLERANCE)
        assert want["grad_norm"] > 0.5
    # Each layout publishes the float64 norm of its gradients, every expert counted once.
    for name in (run, reference_run):
        assert_published_norms_are_exact(runs / name, max_norm=0.5)
    weights = last_model(runs / run)
    assert weights.keys() == reference.keys()
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=EP_TOLERANCE)


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_on_four_processes_with_replicated_and_single_experts(
    tmp_path: Path,
) -> None:
    """4 ranks: EP=2 (each expert on 2 ranks) under DDP (which sums the replicas' gradients),
    FSDP2 and HSDP (which shard the experts over the replicas too); EP=4 (one expert a rank);
    TP=2 with the experts whole on each TP rank, and beside EP=2; gpt-oss under FSDP2 x EP=2.
    All equal the same run without EP, and a run resumes from DDP's checkpoint into experts
    sharded over EP and FSDP2."""
    from tests.workers.expert_parallel import EP_STEPS, RESUMES_OF_4

    assert_ok(torchrun(4, "tests/workers/expert_parallel.py", str(tmp_path), timeout=900))
    for report in rank_reports(tmp_path, 4):
        assert max(report["dispatch"][k] for k in ("output", "gate_up_proj", "down_proj")) < 1e-5
        # gate_up_proj is [4 experts, 2 x 16, 32]: FSDP2 halves dim 1 over the replicas.
        placements = report["placements"]
        for run in ("fsdp_ep2", "hsdp_ep2"):
            assert placements[run] == {
                "mesh": ["ep_replicate", "ep"],
                "placements": ["Shard(1)", "Shard(0)"],
                "local_shape": [2, 16, 32],
            }, run
        # DDP keeps each EP share whole on both replicas.
        assert placements["ddp_ep2"]["local_shape"] == [2, 32, 32]
        assert placements["fsdp_ep4"]["local_shape"] == [1, 32, 32]
    runs = tmp_path / "runs"
    for run in ("ddp_ep2", "fsdp_ep2", "hsdp_ep2", "fsdp_ep4"):
        assert_equals_ddp(runs, run)
    # TP=2 leaves 2 DP ranks of 4 sequences where DDP has 4 of 2, and the load-balancing loss
    # of a micro-batch is not the sum of its halves': so TP with EP is held to TP without it,
    # and TP without it to DDP on the first step's cross entropy (the same weights and tokens).
    assert_equals_ddp(runs, "fsdp_tp2_ep2", reference_run="fsdp_tp2")
    assert_equals_ddp(runs, "gpt_oss_fsdp_ep2", reference_run="gpt_oss_ddp")
    tp_first, ddp_first = (
        read_jsonl(runs / run / "metrics" / "train.jsonl")[0] for run in ("fsdp_tp2", "ddp")
    )
    assert tp_first["nll_loss"] == pytest.approx(ddp_first["nll_loss"], abs=EP_TOLERANCE)
    for name in RESUMES_OF_4:
        (record,) = read_jsonl(runs / name / "metrics" / "train.jsonl")
        assert record["step_nr"] == EP_STEPS + 1
    reference = last_model(runs / "ddp_from_ep2")
    for name in RESUMES_OF_4:
        for key, value in last_model(runs / name).items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=EP_TOLERANCE)


@pytest.mark.distributed
def test_an_expert_parallel_size_that_does_not_fit_is_refused_in_one_line(
    two_rank_checks: Path,
) -> None:
    for report in rank_reports(two_rank_checks / "expert_parallel", 2):
        refusals = report["refusals"]
        assert refusals["ep_size"] == (
            "ep_size is 3, but must divide the DP size (2 = 2 processes / tp_size 1). "
            "Use one of 1, 2."
        )
        assert refusals["experts"] == (
            "gang.ep_size is 2, but must divide the number of experts of every MoE layer (3) "
            "and the DP size (2). Use one of 1."
        )
        assert all("\n" not in line for line in refusals.values())


@pytest.mark.distributed
def test_a_run_resumes_at_another_expert_parallel_size(two_rank_checks: Path) -> None:
    """EP=2 resumes DDP's checkpoint and DDP resumes EP=2's (``reshard_on_resume``): the
    experts are saved at their global shape, so each continues to the same weights."""
    from tests.workers.expert_parallel import EP_STEPS, RESUMES

    runs = two_rank_checks / "expert_parallel" / "runs"
    for name in RESUMES:
        # One step trained, the last: the run took up the other's step EP_STEPS.
        (record,) = read_jsonl(runs / name / "metrics" / "train.jsonl")
        assert record["step_nr"] == EP_STEPS + 1
    into_ep, out_of_ep = (last_model(runs / name) for name in RESUMES)
    assert into_ep["model.layers.1.mlp.experts.down_proj"].shape[0] == 4
    for key, value in out_of_ep.items():
        torch.testing.assert_close(into_ep[key], value, rtol=0, atol=EP_TOLERANCE)


def test_the_flops_of_a_token_count_the_experts_it_is_routed_to() -> None:
    from models.flops import flops_per_token

    model = family_model("Qwen3-MoE")  # 4 experts, top-2
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embedding = model.model.embed_tokens.weight.numel()
    active = sum(p.numel() for p in model.parameters()) - embedding - experts // 2
    attention = 12.0 * 2 * 32 * 16
    assert flops_per_token(model, {}, 16) == 6.0 * active + attention


def test_a_moe_step_without_ep_makes_no_host_sync() -> None:
    """The unit's forward and backward of a mixture of experts (its load-balancing loss and the
    expert load counted too) leave the device alone; EP's one sync a layer is pinned with the
    dispatch test."""
    from tests.sync_detector import HostSyncDetector

    model = family_model("Qwen3-MoE")
    unit = MoeLMTrainUnit(model)
    assert unit.aux_loss_coefficient > 0 and unit.expert_load is not None
    batch = batch_of(model)
    with HostSyncDetector() as detector:
        loss, _ = unit(batch)
        loss.backward()
    assert detector.syncs == []


class _GradientProbe(TrainerCallback):
    """Keeps the final gradients of the first step (normalized by the Trainer)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, *, step_nr: int, model: torch.nn.Module) -> None:
        if not self.grads:
            self.grads = {
                n: p.grad.clone()
                for n, p in unwrap_model(model).named_parameters()
                if p.grad is not None
            }


def trainer_gradients(
    out: Path, coefficient: float, micro_batches: list[TextBatch], gangs: Gangs | None = None
) -> dict[str, torch.Tensor]:
    """The gradients the Trainer steps with: on one process, ``micro_batches`` accumulated into
    one step; on a DP gang of several (DDP), one micro-batch a rank."""
    gangs = gangs or Gangs.single()
    model = family_model("OLMoE")
    model.config.router_aux_loss_coef = coefficient
    if gangs.dp.size > 1:
        model = apply_data_parallel(model, gangs, kind="ddp")
    probe = _GradientProbe()
    trainer = Trainer(
        unit=MoeLMTrainUnit(model),
        data_reader=MapDataReader(
            dataset=micro_batches,
            batch_size=1,
            collate=lambda rows: rows[0],
            gang=gangs.dp,
            num_accumulate=len(micro_batches) // gangs.dp.size,
            shuffle=False,
        ),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        checkpoint_manager=CheckpointManager(out / f"checkpoints_{coefficient}", gangs),
        gangs=gangs,
        max_num_steps=1,
        callbacks=[probe],
        progress=False,
    )
    trainer.run()
    trainer.close()
    return probe.grads


def aux_loss_micro_batches() -> list[TextBatch]:
    """Two micro-batches of 30 and 10 targets."""
    model = family_model("OLMoE")
    return [batch_of(model, rows=3, length=10), batch_of(model, rows=1, length=10)]


def test_the_aux_loss_is_normalized_like_the_main_loss_across_accumulation(
    tmp_path: Path,
) -> None:
    """Two micro-batches of 30 and 10 targets accumulated by the Trainer: the aux loss's share of
    the update is the coefficient times the targets-weighted mean of their aux losses'
    gradients, as the cross entropy's is its mean over all 40 targets."""
    model = family_model("OLMoE")
    micro_batches = aux_loss_micro_batches()
    with_aux = trainer_gradients(tmp_path, 0.01, micro_batches)
    without = trainer_gradients(tmp_path, 0.0, micro_batches)
    total = sum(batch.num_targets for batch in micro_batches)
    model.zero_grad()
    for batch in micro_batches:
        aux = model(input_ids=batch.input_ids, output_router_logits=True).aux_loss
        (aux * batch.num_targets / total).backward()
    for name, param in model.named_parameters():
        share = 0.01 * (param.grad if param.grad is not None else torch.zeros_like(param))
        torch.testing.assert_close(with_aux[name] - without[name], share, rtol=1e-3, atol=2e-7)
    routers = [n for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert (
        max(float(0.01 * dict(model.named_parameters())[n].grad.abs().max()) for n in routers)
        > 1e-5
    )


@pytest.mark.distributed
def test_the_aux_loss_is_normalized_like_the_main_loss_across_dp(
    two_rank_checks: Path, tmp_path: Path
) -> None:
    """The two micro-batches on 2 DDP ranks, one each, step with the gradients of one process
    accumulating both: the load-balancing loss is not divided by the DP size. (Were it, the
    update would hold half its share: the coefficient 0.5 run, which the test tells apart.)"""
    from tests.workers.expert_parallel import AUX_LOSS_COEFFICIENT

    on_two_ranks = torch.load(
        two_rank_checks / "expert_parallel" / "aux_loss_grads.pt", weights_only=True
    )
    micro_batches = aux_loss_micro_batches()
    accumulated = trainer_gradients(tmp_path, AUX_LOSS_COEFFICIENT, micro_batches)
    halved = trainer_gradients(tmp_path, AUX_LOSS_COEFFICIENT / 2, micro_batches)
    assert on_two_ranks.keys() == accumulated.keys()
    for name, grad in accumulated.items():
        torch.testing.assert_close(on_two_ranks[name], grad, rtol=1e-4, atol=1e-7)
    router = "model.layers.0.mlp.gate.weight"
    assert float((on_two_ranks[router] - halved[router]).abs().max()) > 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_an_expert_parallel_run_exports_per_expert_files_from_pretrained_loads(
    two_rank_checks: Path, tmp_path: Path
) -> None:
    """The FSDP2 x EP=2 run's checkpoint holds every expert; its export has one tensor per expert
    (as the model directory it started from) and computes the checkpoint's logits."""
    from safetensors import safe_open

    run = two_rank_checks / "expert_parallel" / "runs" / "fsdp_ep2"
    destination = tmp_path / "exported"
    assert_ok(run_python("-m", "runtime", "export", str(run), str(destination), "--format", "hf"))
    source = two_rank_checks / "expert_parallel" / "model" / "model.safetensors"
    with (
        safe_open(str(destination / "model.safetensors"), framework="pt") as exported_file,
        safe_open(str(source), framework="pt") as source_file,
    ):
        assert sorted(exported_file.keys()) == sorted(source_file.keys())
    exported = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    trained = transformers.AutoModelForCausalLM.from_config(exported.config).eval()
    trained.load_state_dict(last_model(run), strict=True)
    tokens = torch.randint(0, exported.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, trained(tokens).logits)
