"""recipes.lm over the model families people fine-tune, in every layout: the matrix of
tests/recipes/families.py. ``make test`` trains each family in one layout (one launch for all);
``make test-all`` runs every cell, a ``kill -9`` resume and an export per family."""

from __future__ import annotations

import json
import math
from itertools import chain
from pathlib import Path

import pytest
import torch

from gangs import Gangs
from tests.conftest import (
    REPO_ROOT,
    assert_ok,
    kill_9_after_first_checkpoint,
    make_tokenizer_dir,
    read_jsonl,
    run_python,
    torchrun,
    torchrun_command,
)
from tests.recipes.families import (
    FAMILIES,
    FAMILY_BY_NAME,
    LAYOUT_BY_NAME,
    LAYOUTS,
    SEQ_LEN,
    STEPS,
    UNEVEN_VALID,
    Family,
    Layout,
    cells,
    make_family_dir,
    markdown_table,
    run_config,
    write_train,
    write_valid,
)
from tests.recipes.test_lm import last_model, losses, sentences

transformers = pytest.importorskip("transformers")

QUICK_STEPS = 3


def test_the_docs_table_is_the_matrix_the_tests_run() -> None:
    assert markdown_table() in (REPO_ROOT / "docs" / "lm-recipe.md").read_text()
    assert "docs/lm-recipe.md#model-families" in (REPO_ROOT / "README.md").read_text()


@pytest.mark.distributed
def test_every_family_trains_in_its_quick_layout_in_one_launch(tmp_path: Path) -> None:
    """Each family a few steps through recipes.lm in its quick layout, with activation
    checkpointing and a valid set that leaves one rank a batch short; then the 2-rank layouts a
    family cannot train in, each refused before anything is built."""
    for family in FAMILIES:
        make_family_dir(family, tmp_path / family.slug / "model")
    write_train(tmp_path / "train.jsonl")
    write_valid(tmp_path / "valid.jsonl", UNEVEN_VALID)
    result = torchrun(
        2, "tests/workers/lm_families.py", str(tmp_path), str(QUICK_STEPS), timeout=600
    )
    assert_ok(result)
    for family in FAMILIES:
        if family.quick_layout is None:
            continue
        run = tmp_path / family.slug / "run"
        values = losses(run)
        assert len(values) == QUICK_STEPS, family.name
        records = read_jsonl(run / "metrics" / "train.jsonl")
        assert all(r["mfu"] > 0 for r in records)
        # A mixture of experts trains with its load-balancing loss unless asked not to.
        assert all(r.get("router_aux_loss", 0) > 0 for r in records) == family.experts, family.name
        assert values[-1] < values[0], (family.name, values)
        (valid,) = read_jsonl(run / "metrics" / "valid.jsonl")
        assert math.isfinite(valid["nll_loss"]) and valid["nll_loss"] < values[0], family.name

    refusals = json.loads((tmp_path / "refusals.json").read_text())
    expected = {
        f"{family.name}/{layout.name}": words
        for family in FAMILIES
        for layout in LAYOUTS
        if layout.nproc == 2 and (words := family.refused.get(layout.name))
    }
    assert refusals.keys() == expected.keys()
    for cell, words in expected.items():
        assert words in refusals[cell], cell
        assert "Use " in refusals[cell], cell


# ------------------------------------------------------------------- the whole matrix (slow)

BF16_RTOL = 3e-2
"""How far a layout that gathers bf16 parameters may stray from DDP's float32 losses."""
AUX_LOSS_TP_RTOL = 2e-3
"""How far TP may stray from DDP's losses for a family with a load-balancing loss."""

_RUNS: dict[tuple[str, str], Path] = {}
"""The finished matrix runs of this session, by (family, layout): later tests reuse them."""


@pytest.fixture(scope="module")
def matrix_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every family's model directory, and the train and valid files all runs share."""
    directory = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        make_family_dir(family, directory / family.slug / "model")
    write_train(directory / "train.jsonl")
    write_valid(directory / "valid.jsonl", UNEVEN_VALID)
    return directory


def matrix_args(directory: Path, family: Family, layout: Layout, out: Path) -> list[str]:
    model, train, valid = (
        directory / family.slug / "model",
        directory / "train.jsonl",
        directory / "valid.jsonl",
    )
    return ["-m", "recipes.lm", str(out), "--config", *run_config(model, train, valid, layout)]


def finished_run(directory: Path, family: Family, layout: Layout) -> Path:
    """The matrix run of ``family`` in ``layout``, launched unless this session has it."""
    key = (family.name, layout.name)
    if key not in _RUNS:
        out = directory / family.slug / layout.name.replace(" ", "")
        assert_ok(torchrun(layout.nproc, *matrix_args(directory, family, layout, out), timeout=600))
        _RUNS[key] = out
    return _RUNS[key]


def cell_id(family: Family, layout: Layout) -> str:
    return f"{family.slug}-{layout.name.replace(' ', '')}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "layout"), [pytest.param(*cell, id=cell_id(*cell)) for cell in cells()]
)
def test_a_family_trains_in_a_layout_or_is_refused_at_start(
    matrix_dir: Path, family: Family, layout: Layout
) -> None:
    """8 steps through recipes.lm with activation checkpointing; the loss falls, and every
    layout follows DDP's losses and validation scores on the uneven valid set (float32 TP
    closely, bf16 FSDP2 within bf16's precision). A refused layout exits 2 with one line naming
    why."""
    if layout.name in family.refused:
        out = matrix_dir / family.slug / f"refused-{layout.name.replace(' ', '')}"
        result = torchrun(layout.nproc, *matrix_args(matrix_dir, family, layout, out), timeout=600)
        # The first worker to end exits 2 with the one line; none prints a traceback.
        assert "failed (exitcode: 2)" in result.stderr, result.stderr
        errors = {line for line in result.stderr.splitlines() if line.startswith("error:")}
        assert errors and all(family.refused[layout.name] in line for line in errors), errors
        assert "[rank" not in result.stderr
        assert not (out / "checkpoints").exists()
        return
    out = finished_run(matrix_dir, family, layout)
    values = losses(out)
    assert len(values) == STEPS
    assert sum(values[-2:]) / 2 < values[0] - 0.1, values
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    assert [r["step_nr"] for r in valid] == [STEPS // 2, STEPS]
    scores = [r["nll_loss"] for r in valid]
    assert max(scores) < values[0], (scores, values)
    if layout.name != "DDP":
        reference = finished_run(matrix_dir, family, LAYOUT_BY_NAME["DDP"])
        bf16 = "fsdp.param_dtype=bfloat16" in layout.overrides
        rtol = BF16_RTOL if bf16 else 1e-4
        assert values[0] == pytest.approx(losses(reference)[0], rel=rtol)
        if has_aux_loss(family) and layout.name == "TP":
            # TP's one DP rank takes the step's 8 sequences as one micro-batch where DDP's two
            # take 4 each, and a load-balancing loss is not the mean of its halves': the runs
            # part by about 5e-4 after the first update. (EP's tests hold TP to a run of its
            # own micro-batches within 1e-5.)
            rtol = AUX_LOSS_TP_RTOL
        assert values == pytest.approx(losses(reference), rel=rtol)
        # DDP scores the uneven valid set as one process does; so must every layout.
        expected = [r["nll_loss"] for r in read_jsonl(reference / "metrics" / "valid.jsonl")]
        assert scores == pytest.approx(expected, rel=rtol)


def has_aux_loss(family: Family) -> bool:
    """Whether the family trains with a router's load-balancing loss."""
    config = family.config(19)
    return hasattr(config, "output_router_logits") and bool(
        getattr(config, "router_aux_loss_coef", 0)
    )


def resume_layout(family: Family) -> Layout:
    """FSDP2, the layout people fine-tune in; DDP for a family FSDP2 refuses."""
    return LAYOUT_BY_NAME["DDP" if "FSDP2" in family.refused else "FSDP2"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("family", [pytest.param(f, id=f.slug) for f in FAMILIES])
def test_a_family_resumes_bitwise_after_kill_9_and_exports_to_hugging_face(
    matrix_dir: Path, family: Family
) -> None:
    """kill -9 of every process after the first checkpoint; the rerun ends with exactly the
    weights of the uninterrupted run. Its export loads with ``from_pretrained`` and computes the
    logits of the checkpoint's weights."""
    layout = resume_layout(family)
    reference = last_model(finished_run(matrix_dir, family, layout))
    out = matrix_dir / family.slug / "killed"
    killed_at = kill_9_after_first_checkpoint(
        torchrun_command(layout.nproc, matrix_args(matrix_dir, family, layout, out)), out
    )
    assert max(killed_at) < STEPS, "killed after the run's end: nothing was resumed"

    assert_ok(torchrun(layout.nproc, *matrix_args(matrix_dir, family, layout, out), timeout=600))
    assert (
        f"Resumed from the checkpoint of step {max(killed_at)}."
        in (out / "logs" / "rank_0.log").read_text()
    )
    resumed = last_model(out)
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key

    destination = matrix_dir / family.slug / "exported"
    assert_ok(run_python("-m", "runtime", "export", str(out), str(destination), "--format", "hf"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    config = transformers.AutoConfig.from_pretrained(matrix_dir / family.slug / "model")
    trained = transformers.AutoModelForCausalLM.from_config(config).eval()
    trained.load_state_dict(resumed, strict=True)
    tokens = torch.randint(
        0, config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        torch.testing.assert_close(
            exported(tokens).logits, trained(tokens).logits, rtol=1e-5, atol=1e-5
        )


def test_the_valid_file_packs_into_the_sequences_asked_for(tmp_path: Path) -> None:
    from recipes.lm import LMConfig, packed_valid_set
    from runtime.cli.config import load_config
    from runtime.data.text import load_tokenizer

    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", sentences(200, seed=0))
    valid = write_valid(tmp_path / "valid.jsonl", UNEVEN_VALID)
    config = load_config(
        LMConfig,
        overrides=[
            "model.name=llama_debug",
            "data.train=x",
            f"data.valid={valid}",
            f"data.seq_len={SEQ_LEN}",
        ],
    )
    assert len(packed_valid_set(config, load_tokenizer(tokenizer_dir))) == UNEVEN_VALID


def test_a_family_from_scratch_is_initialized_as_transformers_initializes_it(
    tmp_path: Path,
) -> None:
    """model.from_scratch: the recipe builds on meta and initializes module by module; each
    tensor must come out as transformers' own initialization draws it (same mean and spread,
    buffers equal), including tensors a parent module sets (GPT-2's depth-scaled projections)."""
    from recipes.lm import LMConfig, build_model
    from runtime.cli.config import load_config
    from runtime.data.text import load_tokenizer

    for family in FAMILIES:
        model_dir = make_family_dir(family, tmp_path / family.slug)
        overrides = [f"model.hf_path={model_dir}", "data.train=x", "model.from_scratch=true"]
        config = load_config(LMConfig, overrides=overrides)
        built = build_model(config, Gangs.single(), load_tokenizer(model_dir)).model
        reference = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_dir)
        )
        expected = dict(chain(reference.named_parameters(), reference.named_buffers()))
        for name, tensor in chain(built.named_parameters(), built.named_buffers()):
            want = expected[name].detach().float()
            if name in dict(reference.named_buffers()):
                assert torch.equal(tensor.detach().float(), want), (family.name, name)
                continue
            # Two draws' spreads differ by sampling too: a sample's std strays by about
            # std / sqrt(2 (numel - 1)), which a tensor of 4 (gpt-oss's sinks) makes wide.
            sampling_std = 3 / math.sqrt(2 * max(want.numel() - 1, 1))
            spread = (0.25 + sampling_std) * float(want.std()) + 1e-3
            assert abs(float(tensor.detach().float().std()) - float(want.std())) < spread, (
                family.name,
                name,
            )
            # Two draws' means differ by sampling too: about std * sqrt(2 / numel).
            sampling = 4 * float(want.std()) * math.sqrt(2 / want.numel())
            mean_gap = abs(float(tensor.detach().float().mean()) - float(want.mean()))
            assert mean_gap < spread + sampling, (
                family.name,
                name,
            )


def test_a_tp_plan_style_the_recipe_does_not_know_is_refused_by_name() -> None:
    from models.hf import hf_tensor_parallel_plan

    config = FAMILY_BY_NAME["Llama"].config(19)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"mlp.gate_proj as 'packed_colwise'.*gang.tp_size=1"):
        hf_tensor_parallel_plan(model, config)
