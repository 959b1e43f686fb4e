"""Pipeline parallelism: the split, the refusals, and PP=2 on two processes against one process
(tests/workers/pipeline_checks.py): losses, clipped gradient norms, validation and final
weights within 1e-5, with gradient accumulation and uneven valid sets, under every schedule and
with tied embeddings split over two ranks; resumes from PP=2 to 1 and from 1 to 2
(reshard_on_resume); no host sync; the shape flags of torch's schedules behind the private-API
switch; and, slow, every schedule over FSDP2, HSDP and TP=2 on 4 processes and over FSDP2 x
TP=2 on 8, PP=2 x DDP on 4 (with the DP gradient syncs of a step counted: one per step whatever
the accumulation), and tied embeddings over FSDP2 under gpipe and 1f1b (refused under zbv,
whose rank 0 holds both), over TP=2, and at PP=4."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from gangs import FakeGang, Gangs, GangSizeError, setup_parallel_gangs
from gangs.torch_versions import PRIVATE_APIS_ENV_VAR
from models.pipeline import LlamaStage, split_layers, split_model
from runtime.parallel.pipeline import Pipeline, check_pipeline, schedule_available, stage_ids
from runtime.parallel.pipeline_stage import SYNCS_ONCE_WITH_FSDP
from runtime.training.pipeline_step import pipeline_unit
from tests.conftest import assert_ok, read_jsonl, torchrun
from tests.recipes import families
from tests.workers import pipeline_checks
from tests.workers.pipeline_checks import (
    ARGS,
    EIGHT_PROCESS_RUNS,
    FOUR_PROCESS_RUNS,
    NUM_STEPS,
    RUNS,
    TIED,
)
from trainkit_utils.modules import split_ties
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


class Reference(dict[str, tuple[Path, dict[str, Tensor]]]):
    """The runs of pipeline_checks.REFERENCES by name, each its directory and its final weights,
    trained on one process when first asked for."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def __missing__(self, name: str) -> tuple[Path, dict[str, Tensor]]:
        run_dir = self.out / name
        options = pipeline_checks.REFERENCES[name]
        self[name] = (run_dir, pipeline_checks.train(Gangs.single(), run_dir, options))
        return self[name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The same training on one process (with the valid set and without, with tied embeddings,
    with batches of 8): its directory and its final weights."""
    return Reference(tmp_path_factory.mktemp("pipeline_reference"))


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory: pytest.TempPathFactory, reference: Reference) -> Path:
    """One two-process launch of every run of pipeline_checks.RUNS under pp_size=2, and of the
    one-process references resumed from their step 2 at pp_size=2 (the tied one beside)."""
    out = tmp_path_factory.mktemp("pipeline_checks")
    # The worker finds the tied reference beside the other: both are made before it starts.
    one_process_run, _ = reference["valid"]
    assert reference["tied"][0] == one_process_run.parent / "tied"
    assert_ok(
        torchrun(2, "tests/workers/pipeline_checks.py", str(out), "two", str(one_process_run))
    )
    return out


def _whole_weights(run_dir: Path) -> dict[str, Tensor]:
    """The weights of every PP rank's part, each of which lives on one rank."""
    whole: dict[str, Tensor] = {}
    for path in sorted(run_dir.glob("part_*.pt")):
        part = torch.load(path, weights_only=True)
        assert not whole.keys() & part.keys(), "each weight lives on one stage"
        whole.update(part)
    return whole


def _assert_close_records(actual: Path, expected: Path, keys: tuple[str, ...]) -> None:
    records, references = read_jsonl(actual), read_jsonl(expected)
    assert [r["step_nr"] for r in records] == [r["step_nr"] for r in references]
    for record, reference in zip(records, references, strict=True):
        for key in keys:
            assert record[key] == pytest.approx(reference[key], rel=0, abs=TOLERANCE), (key, record)


def _reference_of(options: dict[str, Any]) -> str:
    """The one-process run that a run of ``options`` equals."""
    if "reference" in options:
        return str(options["reference"])
    if options.get("tied", False):
        return "tied"
    return "valid" if options.get("valid", True) else "no_valid"


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    ["1f1b", "interleaved_1f1b", "gpipe", "zbv", "dualpipev", "tied_1f1b", "tied_interleaved_1f1b"],
)
def test_pp2_equals_one_process(pipeline_runs: Path, reference: Reference, name: str) -> None:
    """Every schedule, validating over an uneven valid set (the V-shaped ones too), and a model
    whose tied embeddings are held by stages on different ranks: its two copies (one a rank)
    each equal the one weight of one process, and the norm counts the tie once."""
    if not schedule_available(RUNS[name]["schedule"]):
        pytest.skip(f"torch {torch.__version__} has no {RUNS[name]['schedule']} schedule")
    valid = RUNS[name].get("valid", True)
    expected_dir, expected = reference[_reference_of(RUNS[name])]
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
@pytest.mark.parametrize(
    "run",
    [
        # A one-process checkpoint of step 2.
        "resume_1_to_2",
        # A PP=2 checkpoint of step 2: each rank's optimizer gets its own param groups back
        # (their hyperparameters, its stage's names).
        "resume_2_to_2",
    ],
)
def test_a_checkpoint_of_step_2_resumes_at_pp2_and_ends_where_one_process_ends(
    pipeline_runs: Path, reference: Reference, run: str
) -> None:
    run_dir = pipeline_runs / run
    assert [r["step_nr"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [3, 4]
    _, expected = reference["valid"]
    for key, value in _whole_weights(run_dir).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.distributed
def test_a_pipeline_step_makes_no_host_sync(pipeline_runs: Path) -> None:
    """Steady steps of PP=2 with clipping, and with tied embeddings whose copies sum their
    gradients, read nothing off the device, on either stage."""
    for rank in range(2):
        syncs = json.loads((pipeline_runs / "host_sync" / f"syncs_{rank}.json").read_text())
        assert syncs == [], syncs


@pytest.mark.distributed
def test_tied_embeddings_resume_across_pipeline_sizes(
    pipeline_runs: Path, reference: Reference, tmp_path: Path
) -> None:
    """The one-process checkpoint of a model with tied embeddings (one weight) resumes at PP=2
    (a copy on each rank), and the PP=2 checkpoint (two copies) on one process: both end where
    one process ends."""
    _, expected = reference["tied"]
    run_dir = pipeline_runs / "tied_resume_1_to_2"
    assert [r["step_nr"] for r in read_jsonl(run_dir / "metrics" / "train.jsonl")] == [3, 4]
    for key, value in _whole_weights(run_dir).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)
    weights = pipeline_checks.train(
        Gangs.single(),
        tmp_path,
        TIED,
        resume_from=pipeline_runs / "tied_resume" / "checkpoints" / "step_2",
        max_num_steps=NUM_STEPS,
    )
    assert weights.keys() == expected.keys()
    for key, value in weights.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.distributed
def test_a_split_tie_loads_from_the_one_name_a_source_stores(pipeline_runs: Path) -> None:
    """init_from a file that stores the tied embedding once, as model.embed_tokens.weight: the
    last stage's copy (lm_head.weight) loads it too, without the pipeline's broadcast."""
    source = torch.load(pipeline_runs / "tied_source_0.pt", weights_only=True)
    first, last = (torch.load(pipeline_runs / f"tied_init_{r}.pt") for r in range(2))
    expected = source["model.embed_tokens.weight"]
    assert torch.equal(first["model.embed_tokens.weight"], expected)
    assert torch.equal(last["lm_head.weight"], expected)
    assert "model.embed_tokens.weight" not in last


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
        x: Tensor | tuple[Tensor, ...] = ids
        for stage in stages:
            # A mixture of experts' stages pass their routers' sums on beside the hidden states.
            x = stage(*x) if isinstance(x, tuple) else stage(x)
    logits = x[0] if isinstance(x, tuple) else x
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
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
        x: Tensor | tuple[Tensor, ...] = ids
        for stage in stages:
            # A mixture of experts' stages pass their routers' sums on beside the hidden states.
            x = stage(*x) if isinstance(x, tuple) else stage(x)
    logits = x[0] if isinstance(x, tuple) else x
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
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


def test_tied_embeddings_split_into_a_copy_per_rank_or_one_weight_on_one() -> None:
    model = _hf_llama(tie=True)
    tie = ("model.embed_tokens.weight", "lm_head.weight")
    # 1F1B: the first stage holds the embedding, the last the head, and each part knows the tie.
    first, last = split_model(model, [0], 2)[1], split_model(model, [1], 2)[1]
    assert "lm_head.weight" not in first.state_dict() and "lm_head.weight" in last.state_dict()
    assert "model.embed_tokens.weight" not in last.state_dict()
    assert split_ties(first) == split_ties(last) == [tie]
    # V-shaped: rank 0 holds stages 0 and 3, and the part keeps the one tied weight.
    _, part = split_model(model, [0, 3], 4, split=[1, 1, 1, 0])
    assert part.lm_head.weight is part.model.embed_tokens.weight


@pytest.fixture(scope="module")
def many_process_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``runs(nproc)``: the directory of one launch of pipeline_checks on 4 processes
    (:data:`FOUR_PROCESS_RUNS`: every schedule over FSDP2, HSDP and TP=2, DDP, tied embeddings,
    PP=4, and the runs that count gradient syncs) or 8 (:data:`EIGHT_PROCESS_RUNS`: every
    schedule over FSDP2 x TP=2), each made once."""
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
    [
        *((4, name) for name in sorted(FOUR_PROCESS_RUNS)),
        *((8, name) for name in sorted(EIGHT_PROCESS_RUNS)),
    ],
)
def test_pp2_with_fsdp2_and_tp2_equals_one_process(
    many_process_runs: Callable[[int], Path], reference: Reference, nproc: int, name: str
) -> None:
    runs = {**FOUR_PROCESS_RUNS, **EIGHT_PROCESS_RUNS}
    if not schedule_available(runs[name]["schedule"]):
        pytest.skip(f"torch {torch.__version__} has no {runs[name]['schedule']} schedule")
    expected_dir, expected = reference[_reference_of(runs[name])]
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


@pytest.mark.slow
@pytest.mark.distributed
def test_tied_embeddings_split_apart_by_tp_are_refused_in_one_line(
    many_process_runs: Callable[[int], Path],
) -> None:
    """PP=2 x TP=2 with a plan that splits the tied head's vocabulary but not the embedding's:
    the copies' shards would not sum element by element, so every rank refuses at start."""
    for rank in range(4):
        message = (many_process_runs(4) / f"tied_split_apart_{rank}.txt").read_text()
        assert message.startswith("The tied weights model.embed_tokens.weight, lm_head.weight")
        assert "give both modules the same tensor-parallel style" in message
        assert "\n" not in message


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("kind", "collective"), [("ddp", "all_reduce"), ("fsdp", "reduce_scatter")]
)
def test_dp_gradients_sync_once_per_step_whatever_the_accumulation(
    many_process_runs: Callable[[int], Path], kind: str, collective: str
) -> None:
    """PP=2 over DP=2: the all-reduces of each stage's DDP, or FSDP2's reduce-scatters, per
    optimizer step are as many with 4 micro-batches a step as with 1 (torch alone syncs at the
    end of every micro-batch's schedule.step). The runs with accumulation above hold the math."""
    if kind == "fsdp" and not SYNCS_ONCE_WITH_FSDP:
        pytest.skip(f"torch {torch.__version__} reduces FSDP2's gradients in a private method")
    out = many_process_runs(4)
    for rank in range(4):
        one, four = (
            json.loads((out / f"syncs_{kind}_{n}" / f"grad_syncs_{rank}.json").read_text())
            for n in (1, 4)
        )
        # FSDP2: one per shard unit of the stage (its two layers and the stage); DDP: one bucket.
        assert one == {collective: 3.0 if kind == "fsdp" else 1.0}, (rank, one)
        assert four == one, (rank, four)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("run", "start", "fix"),
    [
        # DDP never sees the weight gradients of a split backward.
        ("zbv_ddp", "pipeline.schedule=zbv computes weight gradients apart", "data_parallel=fsdp"),
        # zbv puts the first and the last stage, which share the tied embedding, on rank 0; FSDP2
        # shards each stage apart and would give each its own copy, untied.
        ("zbv_fsdp_tied", "Two pipeline stages of one rank share a tied weight", "1f1b"),
    ],
)
def test_what_a_v_shaped_schedule_cannot_run_is_refused_in_one_line(
    many_process_runs: Callable[[int], Path], run: str, start: str, fix: str
) -> None:
    if not schedule_available("zbv"):
        pytest.skip(f"torch {torch.__version__} has no zbv schedule")
    for rank in range(4):
        message = (many_process_runs(4) / f"{run}_{rank}.txt").read_text()
        assert message.startswith(start), message
        assert f"Use {fix}" in message or f"Use pipeline.schedule={fix}" in message
        assert "\n" not in message


class _Schedule:
    """A schedule's shape flags as torch keeps them (``ScheduleGPipe``'s), or none."""

    def __init__(self, *, flags: bool) -> None:
        if flags:
            self._stage_forward_initialized = True
            self._stage_backward_initialized = True


def _pipeline_over(schedule: _Schedule) -> Pipeline:
    pipeline = Pipeline.__new__(Pipeline)
    pipeline._schedule = schedule
    pipeline._shapes = ((torch.Size([4, 8]),), (), torch.Size([4, 8]))
    return pipeline


@pytest.mark.parametrize(
    ("private_apis", "flags", "message"),
    [
        ("private", True, None),
        ("public", True, "its flags of them are private, used only on torch >=2.11"),
        ("private", False, f"torch {torch.__version__} has no flags of them"),
    ],
)
def test_a_batch_of_new_shapes_resets_the_private_flags_or_is_refused(
    monkeypatch: pytest.MonkeyPatch, private_apis: str, flags: bool, message: str | None
) -> None:
    """A shorter batch makes the stages infer their shapes again through torch's private
    flags, only where gangs.torch_versions allows private APIs and the schedule has them;
    else it is refused in one line (a torch whose schedules lack the flags: the stand-in)."""
    monkeypatch.setenv(PRIVATE_APIS_ENV_VAR, private_apis)
    schedule = _Schedule(flags=flags)
    pipeline = _pipeline_over(schedule)
    shorter = ((torch.Size([2, 8]),), (), torch.Size([2, 8]))
    if message is None:
        pipeline._forget_shapes(shorter)
        assert vars(schedule) == {
            "_stage_forward_initialized": False,
            "_stage_backward_initialized": False,
        }
        return
    with pytest.raises(ValueError, match="differ from the last batch's") as info:
        pipeline._forget_shapes(shorter)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "Give batches of one shape" in str(info.value)
    assert vars(schedule) == ({} if not flags else dict.fromkeys(vars(schedule), True))


def test_torch_schedules_keep_the_shape_flags_the_pipeline_resets() -> None:
    """The installed torch's schedules still have the private flags (else the fallback above
    is what runs)."""
    from torch.distributed.pipelining import schedules

    for cls, prefix in ((schedules.PipelineScheduleSingle, "_stage"),
                        (schedules.PipelineScheduleMulti, "_stages")):  # fmt: skip
        source = inspect.getsource(cls.__init__)
        for flag in (f"{prefix}_forward_initialized", f"{prefix}_backward_initialized"):
            assert f"self.{flag} = False" in source, (cls, flag)
