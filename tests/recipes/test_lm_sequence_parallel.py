"""recipes.lm under sequence parallelism (``gang.sp_size``): in float32, the losses, clipped
gradient norms, validation scores and final weights of SP=2 on two processes equal those of one
process, for the project's Llama on packed prepared data with document masks and gradient
accumulation, and for a Hugging Face Llama whose key/value heads are fewer than the SP ranks;
checkpoints resume at another SP size and export as without SP; and the layouts SP cannot run
are refused in one line before a launch."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from recipes.lm import LMConfig, recipe
from runtime.cli.config import load_config
from runtime.cli.tools import main as tools_main
from runtime.data.text import HuggingFaceTokenizer, prepare_dataset
from tests.conftest import (
    WORDS,
    assert_ok,
    main_in_process,
    make_tokenizer_dir,
    read_jsonl,
    sft_records,
    torchrun,
)
from tests.recipes.test_lm import (
    TINY_TRAINING,
    last_model,
    make_hf_llama_dir,
    recipe_args,
    repeated,
    run_here,
    write_jsonl,
)

pytest.importorskip("transformers")

EXACT = (
    "trainer.dtype=float32",
    "trainer.amp=false",
    "trainer.max_gradient_norm=0.5",  # clipped: the norm must agree for the update to
    "data.num_accumulate=2",
    "trainer.max_num_steps=4",
    "trainer.validate_every_n_steps=2",
    "trainer.checkpoint_every_n_steps=4",
)


def train_metrics(out: Path, key: str) -> list[float]:
    return [float(r[key]) for r in read_jsonl(out / "metrics" / "train.jsonl") if key in r]


def valid_scores(out: Path) -> list[float]:
    return [float(r["nll_loss"]) for r in read_jsonl(out / "metrics" / "valid.jsonl")]


def assert_same_run(one: Path, sp: Path) -> None:
    for key in ("loss", "grad_norm", "num_targets", "batch_size"):
        assert train_metrics(sp, key) == pytest.approx(train_metrics(one, key), abs=1e-5), key
    assert len(train_metrics(one, "loss")) == 4
    assert valid_scores(sp) == pytest.approx(valid_scores(one), abs=1e-5)
    assert len(valid_scores(one)) == 2
    reference, weights = last_model(one), last_model(sp)
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


def assert_sp_trains_as_one_process(
    tmp_path: Path,
    config: tuple[str, ...],
    *sp_options: str,
    nproc: int = 2,
    one_options: tuple[str, ...] = (),
) -> None:
    """``config`` run in one process (with ``one_options``) into ``tmp_path / "one"`` and with
    ``gang.sp_size=2`` on ``nproc`` processes (with ``sp_options``) into ``tmp_path / "sp"``:
    the same run (:func:`assert_same_run`)."""
    assert_ok(run_here(tmp_path / "one", *config, *one_options))
    sp = torchrun(
        nproc,
        *recipe_args(tmp_path / "sp", *config, *sp_options, "gang.sp_size=2"),
        timeout=300 * nproc // 2,
    )
    assert_ok(sp)
    assert_same_run(tmp_path / "one", tmp_path / "sp")


def assert_same_export(one: Path, sp: Path, destination: Path) -> None:
    """``python -m runtime export OUT DEST --format hf`` of both runs: the same files, the same
    config and the same keys, weights within 1e-5."""
    from safetensors.torch import load_file

    exports = []
    for out in (one, sp):
        exported = destination / out.name
        assert tools_main(["export", str(out), str(exported), "--format", "hf"]) == 0
        exports.append(exported)
    reference_dir, sp_dir = exports
    assert sorted(p.name for p in sp_dir.iterdir()) == sorted(
        p.name for p in reference_dir.iterdir()
    )
    config_json = "config.json"
    assert (sp_dir / config_json).read_text() == (reference_dir / config_json).read_text()
    reference, weights = (load_file(str(d / "model.safetensors")) for d in exports)
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


def prepared_llama_config(tmp_path: Path) -> tuple[str, ...]:
    """The project's Llama on packed prepared data, with document masks."""
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tokenizer", WORDS)
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    for split, seed in (("train", 0), ("valid", 1)):
        text = tmp_path / f"{split}.txt"
        text.write_text("".join(line + "\n" for line in repeated(120, seed=seed)))
        prepare_dataset(tmp_path / split, [text], tokenizer=tokenizer, num_workers=0)
    return (
        *TINY_TRAINING,
        *EXACT,
        "model.name=llama_debug",
        "data.document_mask=true",
        f"tokenizer.path={tokenizer_dir}",
        f"data.train={tmp_path / 'train'}",
        f"data.valid={tmp_path / 'valid'}",
    )


def test_sp2_on_packed_prepared_data_equals_one_process(tmp_path: Path) -> None:
    """The project's Llama: document masks over the whole sequence, positions kept."""
    config = prepared_llama_config(tmp_path)
    assert_sp_trains_as_one_process(tmp_path, config, "trainer.checkpoint_every_n_steps=2")

    # SP does not change the parameters: SP=2's checkpoint of step 2 resumes in one process
    # (a DP gang of one either way, so the data position carries over) to the same weights.
    resumed = tmp_path / "resumed"
    argv = [str(resumed), "--resume-from", str(tmp_path / "sp" / "checkpoints" / "step_2")]
    argv += ["--config", *config, "trainer.reshard_on_resume=true"]
    assert_ok(main_in_process(recipe, LMConfig, argv))
    assert train_metrics(resumed, "loss") == pytest.approx(
        train_metrics(tmp_path / "one", "loss")[2:], abs=1e-5
    )
    reference, weights = last_model(tmp_path / "one"), last_model(resumed)
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


def test_sp2_hugging_face_llama_with_one_kv_head_equals_one_process(tmp_path: Path) -> None:
    """sdpa wrapped through transformers' AttentionInterface; the one key/value head is
    repeated for the two SP ranks; positions given as position_ids. The SP run checkpoints its
    activations: the recomputed forward makes its all-to-alls again, in step on both ranks."""
    model_dir = make_hf_llama_dir(tmp_path / "model", num_key_value_heads=1)
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(30, seed=3)])
    config = (
        *TINY_TRAINING,
        *EXACT,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
    )
    assert_sp_trains_as_one_process(tmp_path, config, "model.activation_checkpointing=true")
    # SP does not change the parameters: its Hugging Face export is that of one process.
    assert_same_export(tmp_path / "one", tmp_path / "sp", tmp_path / "exported")


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_sp2(tmp_path: Path) -> None:
    """The other direction of the resume in the packed test: one process's checkpoint of step
    2 resumes at SP=2 (a DP gang of one either way) to the same losses and weights."""
    config = (*prepared_llama_config(tmp_path), "trainer.checkpoint_every_n_steps=2")
    assert_ok(run_here(tmp_path / "one", *config))
    resumed = tmp_path / "resumed"
    step_2 = tmp_path / "one" / "checkpoints" / "step_2"
    sp = torchrun(
        2, "-m", "recipes.lm", str(resumed), "--resume-from", str(step_2),
        "--config", *config, "gang.sp_size=2", "trainer.reshard_on_resume=true",
        timeout=300,
    )  # fmt: skip
    assert_ok(sp)
    assert train_metrics(resumed, "loss") == pytest.approx(
        train_metrics(tmp_path / "one", "loss")[2:], abs=1e-5
    )
    assert valid_scores(resumed) == pytest.approx(valid_scores(tmp_path / "one")[1:], abs=1e-5)
    reference, weights = last_model(tmp_path / "one"), last_model(resumed)
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "batch_size"),
    [
        # FSDP2 over DP x SP = 4 ranks, two data shards of 4 sequences: one process reads 8.
        (("data_parallel=fsdp",), 8),
        # TP splits the 4 heads in two, SP the two left; one data shard.
        (("gang.tp_size=2",), 4),
    ],
    ids=["fsdp_dp2", "tp2"],
)
def test_sp2_on_four_processes_equals_one_process(
    tmp_path: Path, layout: tuple[str, ...], batch_size: int
) -> None:
    # A smaller step than make test's: FSDP2 reduces over 4 ranks in another order than one
    # process sums, and Adam's first steps magnify such float32 differences (FSDP2 alone, DP=2
    # without SP, already differs from one process by 2.5e-5 in the fourth step's norm at lr 0.01).
    config = (*prepared_llama_config(tmp_path), "optimizer.lr=0.001")
    assert_sp_trains_as_one_process(
        tmp_path, config, *layout, nproc=4, one_options=(f"data.batch_size={batch_size}",)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("data.seq_len=30", r"data.seq_len \(30\) does not split over gang.sp_size \(4\)"),
        ("task=dpo", "whose loss needs each sequence whole"),
    ],
)
def test_a_layout_sp_cannot_run_is_refused_by_the_config(change: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(
            LMConfig,
            overrides=["model.name=llama_debug", "data.train=x.jsonl", "gang.sp_size=4", change],
        )


def test_sp2_sft_on_masked_targets_equals_one_process(tmp_path: Path) -> None:
    """Examples padded to the longest, then to a length the SP ranks divide; a rank whose half
    holds only prompt tokens has no targets, and still takes part in the all-to-alls."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    rng = random.Random(5)

    def records(count: int) -> list[dict[str, object]]:
        return sft_records(rng, count, max_prompt_words=14)

    config = (
        *TINY_TRAINING,
        *EXACT,
        "task=sft",
        f"model.hf_path={model_dir}",
        f"data.train={write_jsonl(tmp_path / 'train.jsonl', records(80))}",
        f"data.valid={write_jsonl(tmp_path / 'valid.jsonl', records(12))}",
    )
    assert_sp_trains_as_one_process(tmp_path, config)


def test_heads_that_sp_does_not_divide_are_refused_in_one_line_on_every_rank(
    tmp_path: Path,
) -> None:
    from tests.faults.test_bad_config import rank_stderr_lines

    model_dir = make_hf_llama_dir(
        tmp_path / "model", hidden_size=24, num_attention_heads=3, num_key_value_heads=1
    )
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(20, seed=2)])
    out, logs = tmp_path / "run", tmp_path / "torchrun_logs"
    args = [*TINY_TRAINING, f"model.hf_path={model_dir}", f"data.train={train}", "gang.sp_size=2"]
    result = torchrun(
        2, "--log-dir", str(logs), "--redirects", "2", "-m", "recipes.lm", str(out),
        "--config", *args, timeout=300,
    )  # fmt: skip
    expected = (
        "error: The model's 3 attention heads do not split over sp_size 2 x tp_size 1: each SP "
        "rank attends with num_heads / (sp_size x tp_size) heads. With tp_size 1, use sp_size 1 "
        "or 3."
    )
    for lines in rank_stderr_lines(logs):
        assert [line for line in lines if line.startswith("error: ")] == [expected], lines
    assert "exitcode  : 2" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
def test_sp2_x_ep2_equals_sp2_without_experts_split(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE: EP=2 over the two SP ranks (the ranks with different tokens) against
    the same SP=2 run with every expert on each rank. Both compute the load-balancing loss over
    each rank's own tokens (as DP does), so they agree; one process would not."""
    from tests.recipes.families import FAMILY_BY_NAME, make_family_dir

    model_dir = make_family_dir(FAMILY_BY_NAME["Qwen3-MoE"], tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(30, seed=3)])
    config = (
        *TINY_TRAINING,
        *EXACT,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
        "gang.sp_size=2",
    )
    for name, extra in (("sp", ()), ("sp_ep", ("gang.ep_size=2",))):
        assert_ok(torchrun(2, *recipe_args(tmp_path / name, *config, *extra), timeout=300))
    assert_same_run(tmp_path / "sp", tmp_path / "sp_ep")


@pytest.mark.slow
def test_sp2_lora_equals_one_process(tmp_path: Path) -> None:
    """LoRA adapters on the projections around the wrapped attention."""
    pytest.importorskip("peft")
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(30, seed=3)])
    config = (
        *TINY_TRAINING,
        *EXACT,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
        "lora.rank=4",
    )
    assert_sp_trains_as_one_process(tmp_path, config)


# Every dense Hugging Face family of the matrix (tests/recipes/families.py) at SP=2, through the
# attention it loads with: (family, data.seq_len, words of the one-line refusal or None).
FAMILY_CASES = [
    ("Llama", 32, None),
    ("Mistral", 32, "sliding window of 16 tokens, shorter than data.seq_len (32)"),
    ("Mistral", 16, None),  # a window as long as the sequence masks nothing
    ("Qwen2", 32, None),  # use_sliding_window is false: no layer has a window
    ("Qwen3", 32, None),
    ("Gemma 2", 32, "sliding window of 8 tokens, shorter than data.seq_len (32)"),
    ("Gemma 2", 8, None),  # eager attention with soft-capping
    ("GPT-2", 32, None),  # absolute positions, no key/value groups
    ("Phi-3", 32, None),
    ("OLMo-2", 32, None),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "seq_len", "refusal"),
    FAMILY_CASES,
    ids=[f"{name.replace(' ', '')}-{seq_len}" for name, seq_len, _ in FAMILY_CASES],
)
def test_sp2_of_each_dense_family_equals_one_process_or_is_refused(
    tmp_path: Path, name: str, seq_len: int, refusal: str | None
) -> None:
    from tests.faults.test_bad_config import rank_stderr_lines
    from tests.recipes.families import FAMILY_BY_NAME, make_family_dir

    model_dir = make_family_dir(FAMILY_BY_NAME[name], tmp_path / "model")
    # No dropout (GPT-2's is 0.1): each rank would drop other elements than one process.
    config_file = model_dir / "config.json"
    hf_config = json.loads(config_file.read_text())
    for key, value in hf_config.items():
        if key.endswith(("pdrop", "dropout")) and isinstance(value, float):
            hf_config[key] = 0.0
    config_file.write_text(json.dumps(hf_config))
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(30, seed=3)])
    config = (
        *TINY_TRAINING,
        *EXACT,
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
        f"data.seq_len={seq_len}",
    )
    if refusal is not None:
        out, logs = tmp_path / "sp", tmp_path / "torchrun_logs"
        result = torchrun(
            2, "--log-dir", str(logs), "--redirects", "2", "-m", "recipes.lm", str(out),
            "--config", *config, "gang.sp_size=2", timeout=300,
        )  # fmt: skip
        assert "exitcode  : 2" in result.stderr, result.stderr[-3000:]
        for lines in rank_stderr_lines(logs):
            errors = [line for line in lines if line.startswith("error: ")]
            assert len(errors) == 1 and refusal in errors[0], lines
        return
    assert_sp_trains_as_one_process(tmp_path, config)
