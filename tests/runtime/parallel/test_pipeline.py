"""Pipeline parallelism: the split, the refusals, and PP=2 on two processes against one process
(tests/workers/pipeline_checks.py): losses, clipped gradient norms, validation and final
weights within 1e-5, with gradient accumulation and uneven valid sets; resumes from PP=2 to 1
and from 1 to 2 (reshard_on_resume); no host sync; and, slow, PP=2 x FSDP2 and PP=2 x TP=2 on 4
processes, PP=2 x FSDP2 x TP=2 on 8."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from gangs import FakeGang, Gangs, GangSizeError, setup_parallel_gangs
from models.pipeline import LlamaStage, split_layers, split_model
from runtime.parallel.pipeline import check_pipeline, schedule_available, stage_ids
from runtime.training.pipeline_step import pipeline_unit
from tests.conftest import assert_ok, read_jsonl, torchrun
from tests.recipes import families
from tests.workers import pipeline_checks
from tests.workers.pipeline_checks import ARGS, FOUR_PROCESS_RUNS, NUM_STEPS, RUNS
from units import TrainUnit
from units.lm import LMTrainUnit

TOLERANCE = 1e-5


def test_pp_size_must_divide_the_processes() -> None:
    with pytest.raises(GangSizeError, match=r"^pp_size is 2, but must divide the number of pro"):
        setup_parallel_gangs(FakeGang(), pp_size=2)
    with pytest.raises(GangSizeError) as info:
        setup_parallel_gangs(FakeGang(), pp_size=2)
    assert info.value.naming({"pp_size": "gang.pp_size"}).startswith("gang.pp_size is 2")


def test_split_layers_balances_and_follows_an_override() -> None:
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    # The remainder goes to the stages before the last, which also computes the head.
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 3), "3 stages, but the model has only 2 layers"),
        ((4, 2, [1, 2]), "pipeline.split must give the layers of each of the 2 stages"),
    ],
)
def test_split_layers_refusals(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        split_layers(*args)
    assert "\n" not in str(info.value)


def test_stage_ids_of_the_schedules() -> None:
    assert stage_ids("1f1b", pp_rank=1, pp_size=4, stages_per_rank=1) == [1]
    assert stage_ids("interleaved_1f1b", pp_rank=1, pp_size=2, stages_per_rank=2) == [1, 3]
    assert stage_ids("zbv", pp_rank=0, pp_size=2, stages_per_rank=2) == [0, 3]
    assert stage_ids("dualpipev", pp_rank=1, pp_size=2, stages_per_rank=2) == [1, 2]


@pytest.mark.parametrize(
    ("schedule", "options", "message"),
    [
        ("pipedream", {}, "pipeline.schedule must be one of"),
        ("1f1b", {"num_microbatches": 1}, "fewer than the 2 that pipeline.schedule=1f1b needs"),
        ("zbv", {"num_microbatches": 2, "stages_per_rank": 2}, "fewer than the 4"),
        ("zbv", {"stages_per_rank": 1}, "exactly two stages per rank"),
        ("1f1b", {"stages_per_rank": 2}, "runs one stage per rank"),
        ("interleaved_1f1b", {"stages_per_rank": 1}, "Set it to 2 or more"),
        ("1f1b", {"batch_size": 6, "num_microbatches": 4}, "must divide the batch size"),
    ],
)
def test_pipeline_refusals_are_one_line(
    schedule: str, options: dict[str, Any], message: str
) -> None:
    kwargs: dict[str, Any] = {"pp_size": 2, "stages_per_rank": 1, "num_microbatches": 4}
    kwargs.update(options)
    with pytest.raises(ValueError, match=message) as info:
        check_pipeline(schedule, **kwargs)
    assert "\n" not in str(info.value)


def test_a_unit_that_has_not_opted_in_is_refused_in_one_line() -> None:
    class PlainUnit(TrainUnit[Any]):
        def __call__(self, batch: Any) -> tuple[Tensor, int | None]:
            raise NotImplementedError

    with pytest.raises(ValueError, match="PlainUnit cannot run under pipeline") as info:
        pipeline_unit(PlainUnit(torch.nn.Linear(1, 1)), "train unit")
    assert "implement stage_inputs, stage_loss and record_loss" in str(info.value)
    assert "\n" not in str(info.value)
    assert pipeline_unit(LMTrainUnit(torch.nn.Linear(1, 1)), "train unit") is not None


def test_stages_compute_the_whole_model_and_keep_its_names() -> None:
    model = pipeline_checks.whole_model()
    ids = torch.randint(0, ARGS.vocab_size, (2, 8))
    expected = model(ids)
    stages, part = split_model(model, [0, 1, 2, 3], 4, split=[0, 2, 1, 1])
    x = ids
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-6)
    assert isinstance(part, LlamaStage)
    assert part.state_dict().keys() == model.state_dict().keys()
    _, part = split_model(model, [1, 2], 4)
    assert set(part.state_dict()) == {
        k for k in model.state_dict() if k.startswith(("model.layers.1.", "model.layers.2."))
    }


Reference = dict[str, tuple[Path, dict[str, Tensor]]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The same training on one process, with the valid set and without: its directory and its
    final weights."""
    out = tmp_path_factory.mktemp("pipeline_reference")
    return {
        name: (out / name, pipeline_checks.train(Gangs.single(), out / name, {"valid": valid}))
        for name, valid in (("valid", True), ("no_valid", False))
    }


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory: pytest.TempPathFactory, reference: Reference) -> Path:
    """One two-process launch of every run of pipeline_checks.RUNS under pp_size=2, and of the
    one-process reference resumed from its step 2 at pp_size=2."""
    out = tmp_path_factory.mktemp("pipeline_checks")
    one_process_run = reference["valid"][0]
    assert_ok(
        torchrun(2, "tests/workers/pipeline_checks.py", str(out), "two", str(one_process_run))
    )
    return out


def _whole_weights(run_dir: Path) -> dict[str, Tensor]:
    parts = [torch.load(run_dir / f"part_{r}.pt", weights_only=True) for r in range(2)]
    assert not parts[0].keys() & parts[1].keys(), "each weight lives on one stage"
    return {**parts[0], **parts[1]}


def _assert_close_records(actual: Path, expected: Path, keys: tuple[str, ...]) -> None:
    records, references = read_jsonl(actual), read_jsonl(expected)
    assert [r["step_nr"] for r in records] == [r["step_nr"] for r in references]
    for record, reference in zip(records, references, strict=True):
        for key in keys:
            assert record[key] == pytest.approx(reference[key], rel=0, abs=TOLERANCE), (key, record)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "gpipe", "zbv", "dualpipev"])
def test_pp2_equals_one_process(pipeline_runs: Path, reference: Reference, name: str) -> None:
    if not schedule_available(RUNS[name]["schedule"]):
        pytest.skip(f"torch {torch.__version__} has no {RUNS[name]['schedule']} schedule")
    valid = RUNS[name].get("valid", True)
    expected_dir, expected = reference["valid" if valid else "no_valid"]
    run_dir = pipeline_runs / name
    # Every rank publishes the same loss: rank 0 (the first stage) writes the metrics.
    _assert_close_records(
        run_dir / "metrics" / "train.jsonl",
        expected_dir / "metrics" / "train.jsonl",
        ("loss", "nll_loss", "grad_norm", "num_targets"),
    )
    grad_norms = [r["grad_norm"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl")]
    assert max(grad_norms) > 0.5, "clipping bites in these runs"
    if valid:
        _assert_close_records(
            run_dir / "metrics" / "valid.jsonl",
            expected_dir / "metrics" / "valid.jsonl",
            ("nll_loss",),
        )
    weights = _whole_weights(run_dir)
    assert weights.keys() == expected.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.distributed
def test_resume_of_pp1_at_pp2(pipeline_runs: Path, reference: Reference) -> None:
    """A one-process checkpoint of step 2 resumes at PP=2 and ends where one process ends."""
    run_dir = pipeline_runs / "resume_1_to_2"
    assert [r["step_nr"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [3, 4]
    _, expected = reference["valid"]
    for key, value in _whole_weights(run_dir).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.distributed
def test_resume_of_pp2_at_pp2(pipeline_runs: Path, reference: Reference) -> None:
    """A PP=2 checkpoint of step 2 resumes at PP=2: each rank's optimizer gets its own param
    groups back (their hyperparameters, its stage's names), and the run ends where one process
    ends."""
    run_dir = pipeline_runs / "resume_2_to_2"
    assert [r["step_nr"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [3, 4]
    _, expected = reference["valid"]
    for key, value in _whole_weights(run_dir).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.distributed
def test_a_pipeline_step_makes_no_host_sync(pipeline_runs: Path) -> None:
    """Steady steps of PP=2 with clipping read nothing off the device, on either stage."""
    for rank in range(2):
        syncs = json.loads((pipeline_runs / "host_sync" / f"syncs_{rank}.json").read_text())
        assert syncs == [], syncs


@pytest.mark.distributed
def test_validation_under_a_v_shaped_schedule_is_refused_in_one_line(pipeline_runs: Path) -> None:
    if not schedule_available("zbv"):
        pytest.skip(f"torch {torch.__version__} has no zbv schedule")
    for rank in range(2):
        message = (pipeline_runs / f"zbv_valid_{rank}.txt").read_text()
        assert message.startswith("pipeline.schedule=zbv cannot validate"), message
        assert "\n" not in message


@pytest.mark.distributed
def test_gangs_put_pp_outermost(pipeline_runs: Path) -> None:
    reports = [json.loads((pipeline_runs / f"gangs_{r}.json").read_text()) for r in range(2)]
    assert [r["pp_rank"] for r in reports] == [0, 1]
    assert reports[0]["repr"] == "Gangs(root=2, pp=2, dp=1, tp=1)"


@pytest.mark.distributed
def test_resume_of_pp2_at_pp1(pipeline_runs: Path, reference: Reference, tmp_path: Path) -> None:
    """A PP=2 checkpoint of step 2 resumes on one process (reshard_on_resume) and ends where one
    process ends."""
    _, expected = reference["valid"]
    weights = pipeline_checks.train(
        Gangs.single(),
        tmp_path,
        {},
        resume_from=pipeline_runs / "resume" / "checkpoints" / "step_2",
        max_num_steps=NUM_STEPS,
    )
    assert [r["step_nr"] for r in read_jsonl(tmp_path / "metrics" / "train.jsonl")] == [3, 4]
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


def _hf_llama(*, tie: bool) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_hugging_face_llama_splits_into_stages_that_compute_its_logits() -> None:
    model = _hf_llama(tie=False)
    ids = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        stages, part = split_model(model, [0, 1], 2)
        x = ids
        for stage in stages:
            x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
    # Stage 0 holds layers 0 and 1 (balanced), stage 1 layer 2 with the norm and the head.
    assert "lm_head.weight" in stages[1].state_dict()
    assert {k for k in stages[0].state_dict() if k.startswith("model.layers.")} == {
        k for k in model.state_dict() if k.startswith(("model.layers.0.", "model.layers.1."))
    }
    assert part.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("family", [pytest.param(f, id=f.slug) for f in families.FAMILIES])
def test_a_hugging_face_family_splits_into_stages_that_compute_its_logits(
    family: families.Family,
) -> None:
    """Every family of the recipe's matrix, split into four stages run in order (an embedding
    stage, one layer each, a head stage), on sequences longer than the sliding windows (Mistral's
    16, Gemma 2's 8 on every other layer): the logits of the whole model, with Gemma 2's final
    soft-capping and GPT-2's absolute positions, under the whole model's names."""
    transformers = pytest.importorskip("transformers")
    config = family.config(40)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 40, (2, 40))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        stages, part = split_model(model, [0, 1, 2, 3], 4, split=[0, 1, 1, 0])
        x = ids
        for stage in stages:
            x = stage(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
    assert part.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize(
    "family", [pytest.param(f, id=f.slug) for f in families.FAMILIES if not f.experts]
)
def test_each_rank_materializes_its_part_on_meta_as_the_whole_model_starts(
    family: families.Family,
) -> None:
    """Built on meta, split, and each rank's part materialized on its own (as the recipe does
    under PP=2; V-shaped for tied embeddings): together the parts hold exactly the weights of the
    whole model materialized from the same seed, GPT-2's depth-scaled projections included."""
    transformers = pytest.importorskip("transformers")
    from models.hf import hf_init_fn
    from runtime.parallel.materialize import materialize_model

    def on_meta() -> Any:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(family.config(40))

    whole = on_meta()
    materialize_model(whole, device=torch.device("cpu"), seed=2, init_fn=hf_init_fn(whole))
    tied = family.config(40).tie_word_embeddings
    ranks = ([0, 3], [1, 2]) if tied else ([0], [1])
    weights: dict[str, Tensor] = {}
    for ids in ranks:
        model = on_meta()
        _, part = split_model(model, ids, 2 * len(ids), split=[0, 1, 1, 0] if tied else None)
        materialize_model(part, device=torch.device("cpu"), seed=2, init_fn=hf_init_fn(model))
        weights |= part.state_dict()
    expected = whole.state_dict()
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(weights[key], value), key


def test_a_family_the_stages_do_not_reproduce_is_refused_by_name() -> None:
    """Granite scales its embeddings, residuals and logits by config factors that a stage would
    leave out: refused in one line, before anything is built."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=r"model_type 'granite'.*gemma2.*Use gang.pp_size=1"
    ) as info:
        split_model(model, [0], 2)
    assert "\n" not in str(info.value)


def test_tied_embeddings_need_the_first_and_last_stages_on_one_rank() -> None:
    model = _hf_llama(tie=True)
    with pytest.raises(ValueError, match="ties its input and output embeddings") as info:
        split_model(model, [0], 2)
    assert "\n" not in str(info.value)
    # V-shaped: rank 0 holds stages 0 and 3, and the part keeps the one tied weight.
    _, part = split_model(model, [0, 3], 4, split=[1, 1, 1, 0])
    assert part.lm_head.weight is part.model.embed_tokens.weight


@pytest.fixture(scope="module")
def many_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``runs(nproc)``: the directory of one launch of pipeline_checks on 4 processes (PP=2 x
    FSDP2 over DP=2, and PP=2 x TP=2 with two stages a rank) or 8 (PP=2 x FSDP2 x TP=2), each
    made once."""
    outs: dict[int, Path] = {}

    def runs(nproc: int) -> Path:
        if nproc not in outs:
            out = tmp_path_factory.mktemp(f"pipeline_checks_{nproc}")
            which = {4: "four", 8: "eight"}[nproc]
            assert_ok(
                torchrun(nproc, "tests/workers/pipeline_checks.py", str(out), which, timeout=600)
            )
            outs[nproc] = out
        return outs[nproc]

    return runs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "name"),
    [*((4, name) for name in sorted(FOUR_PROCESS_RUNS)), (8, "pp2_fsdp2_tp2")],
)
def test_pp2_with_fsdp2_and_tp2_equals_one_process(
    many_process_runs: Callable[[int], Path], reference: Reference, nproc: int, name: str
) -> None:
    expected_dir, expected = reference["valid"]
    run_dir = many_process_runs(nproc) / name
    _assert_close_records(
        run_dir / "metrics" / "train.jsonl",
        expected_dir / "metrics" / "train.jsonl",
        ("loss", "nll_loss", "grad_norm", "num_targets"),
    )
    _assert_close_records(
        run_dir / "metrics" / "valid.jsonl", expected_dir / "metrics" / "valid.jsonl", ("nll_loss",)
    )
    weights = _whole_weights(run_dir)
    assert weights.keys() == expected.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)
