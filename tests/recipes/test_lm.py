"""recipes.lm: a Hugging Face Llama and the project's Llama on JSONL files, SFT, export to HF.

A one-process run that nothing kills runs in this process (``runtime.main``, the command
line's path, without a process's start-up); kill -9 and torchrun need real processes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from checkpoint import CheckpointManager
from gangs import Gangs
from models.flops import flops_per_token
from models.llama import Llama, hf_config, llama_args
from recipes.lm import LMConfig, build_readers, recipe
from runtime.cli.config import load_config
from runtime.data.text import (
    IGNORE_INDEX,
    ByteTokenizer,
    HuggingFaceTokenizer,
    InstructionDataset,
    InstructionFields,
    collate_instructions,
    load_tokenizer,
    prepare_dataset,
)
from runtime.data.text.files import TextDataError
from runtime.data.text.prepared import PreparedDataError
from tests.conftest import (
    WORDS,
    assert_ok,
    kill_9_after_first_checkpoint,
    main_in_process,
    make_tokenizer_dir,
    read_jsonl,
    run_python,
    torchrun,
)

transformers = pytest.importorskip("transformers")


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(count)]


def repeated(count: int, seed: int) -> list[str]:
    """``count`` documents drawn from eight sentences: text a tiny model learns in a few steps."""
    pool = sentences(8, seed=seed)
    rng = random.Random(seed)
    return [rng.choice(pool) for _ in range(count)]


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def make_hf_model_dir(directory: Path, *, architecture: str = "Llama", **overrides: object) -> Path:
    """A tiny Hugging Face causal LM of ``architecture`` (``Llama``, ``Qwen2``, ...) saved here:
    config.json, model.safetensors, tokenizer files; ``overrides`` change its config."""
    make_tokenizer_dir(directory, sentences(200, seed=0))
    vocab_size = load_tokenizer(directory).vocab_size
    options: dict[str, object] = {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config = getattr(transformers, f"{architecture}Config")(**(options | overrides))
    torch.manual_seed(0)
    getattr(transformers, f"{architecture}ForCausalLM")(config).save_pretrained(directory)
    return directory


def make_hf_llama_dir(directory: Path, **overrides: object) -> Path:
    return make_hf_model_dir(directory, **overrides)


def recipe_args(out: Path, *config: str) -> list[str]:
    return ["-m", "recipes.lm", str(out), "--config", *config]


def run_here(out: Path, *config: str) -> subprocess.CompletedProcess[str]:
    """``python -m recipes.lm OUT --config CONFIG...`` in this process."""
    return main_in_process(recipe, LMConfig, recipe_args(out, *config)[2:])


TINY_TRAINING = (
    "data.seq_len=32",
    "data.batch_size=4",
    "data.num_workers=0",
    "trainer.publish_metrics_every_n_steps=1",
    "trainer.validate_every_n_steps=1000",
    "trainer.gc_every_n_steps=null",
    "optimizer.lr=0.01",
    "optimizer.warmup_steps=2",
)


def losses(out: Path) -> list[float]:
    return [float(r["loss"]) for r in read_jsonl(out / "metrics" / "train.jsonl") if "loss" in r]


def last_model(out: Path) -> dict[str, torch.Tensor]:
    manager = CheckpointManager(out / "checkpoints", Gangs.single())
    return manager.read_model_state(manager.select_checkpoint("last", lower_better=True))


# ------------------------------------------------------------------------------ the model


def test_the_llama_model_computes_the_logits_of_hugging_face_llama() -> None:
    args = llama_args("llama_debug", vocab_size=97, max_seq_len=64)
    model = Llama(args)
    torch.manual_seed(0)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            model.init_module(name, module)
        elif isinstance(module, nn.RMSNorm):
            nn.init.normal_(module.weight, 1.0, 0.1)
    config = {k: v for k, v in hf_config(args, bos_id=1, eos_id=2).items() if k != "architectures"}
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    reference.load_state_dict(model.state_dict(), strict=True)
    tokens = torch.randint(0, 97, (2, 19))
    torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5)

    # One document per sequence: the document mask changes nothing.
    one_document = torch.zeros_like(tokens)
    positions = torch.arange(19).expand(2, 19)
    masked = model(tokens, document_ids=one_document, positions=positions)
    torch.testing.assert_close(masked, model(tokens), rtol=1e-5, atol=1e-5)


def test_the_document_mask_keeps_attention_inside_each_document() -> None:
    model = Llama(llama_args("llama_debug", vocab_size=50, max_seq_len=32)).eval()
    first, second = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 5))
    packed = torch.cat([first, second], dim=1)
    document_ids = torch.tensor([[0] * 7 + [1] * 5])
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    logits = model(packed, document_ids=document_ids, positions=positions)
    torch.testing.assert_close(logits[:, 7:], model(second), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ SFT data


def test_sft_targets_and_counts_cover_the_response_tokens_only(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(make_tokenizer_dir(tmp_path / "tok", sentences(100, seed=1)))
    data = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"prompt": "the cat sat", "response": "on a mat"},
            {"prompt": "dogs ran far over green hills", "response": "and birds sang"},
        ],
    )
    dataset = InstructionDataset(data, tokenizer=tokenizer, max_len=64, bucket_size=1)
    batch = collate_instructions([dataset[0], dataset[1]], pad_id=tokenizer.eos_id)
    # 3 response words and EOS in each example.
    assert batch.num_targets == 8
    assert int((batch.target_ids != IGNORE_INDEX).sum()) == 8
    for row, (tokens, prompt_len) in enumerate([dataset[0], dataset[1]]):
        targets = batch.target_ids[row]
        assert (targets[: prompt_len - 1] == IGNORE_INDEX).all()
        assert targets[prompt_len - 1 : len(tokens) - 1].tolist() == tokens[prompt_len:]
        assert tokens[-1] == tokenizer.eos_id
        assert len(tokens) - prompt_len == 4


def test_chat_messages_are_rendered_with_the_tokenizer_template(tmp_path: Path) -> None:
    directory = make_tokenizer_dir(tmp_path / "tok", [*sentences(100, seed=1), "user assistant"])
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    dataset = InstructionDataset(
        data, tokenizer=tokenizer, max_len=64, fields=InstructionFields(messages="messages")
    )
    tokens, prompt_len = dataset[0]
    assert tokens[0] == tokenizer.bos_id
    assert tokenizer.decode(tokens[prompt_len:-1]).split() == ["sat"]


def test_sft_examples_are_read_from_parquet_too(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    tokenizer = load_tokenizer(None)
    pq.write_table(
        pa.table({"prompt": ["ab", "c"], "response": ["d", "ef"]}), tmp_path / "s.parquet"
    )
    dataset = InstructionDataset(tmp_path / "s.parquet", tokenizer=tokenizer, max_len=16)
    responses = sorted(tokenizer.decode(tokens[length:-1]) for tokens, length in dataset)
    assert responses == ["d", "ef"]


def test_a_bad_sft_line_names_its_file_and_line(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(None)
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl: line 2: .*'response'"):
        InstructionDataset(data, tokenizer=tokenizer, max_len=16)


# ------------------------------------------------------------------------------ the recipe


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "dp_size"),
    [
        # make test trains transformers models under FSDP2 and TP in test_families' one launch.
        pytest.param("data_parallel=fsdp", 2, marks=pytest.mark.slow),
        pytest.param("gang.tp_size=2", 1, marks=pytest.mark.slow),
    ],
)
def test_a_hugging_face_llama_trains_on_two_ranks(
    tmp_path: Path, layout: str, dp_size: int
) -> None:
    """FSDP2 over the decoder layers, and tensor parallelism from the config's TP plan."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(400, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(40, seed=2)])
    out = tmp_path / "run"
    result = torchrun(
        2,
        *recipe_args(
            out,
            *TINY_TRAINING,
            f"model.hf_path={model_dir}",
            f"data.train={train}",
            f"data.valid={valid}",
            layout,
            "trainer.max_num_steps=30",
            "trainer.checkpoint_every_n_steps=30",
            "trainer.validate_every_n_steps=30",
        ),
        timeout=600,
    )
    assert_ok(result)
    values = losses(out)
    assert len(values) == 30
    assert {r["batch_size"] for r in read_jsonl(out / "metrics" / "train.jsonl")} == {4 * dp_size}
    assert sum(values[-5:]) / 5 < 0.6 * sum(values[:5]) / 5, values
    valid_records = read_jsonl(out / "metrics" / "valid.jsonl")
    assert valid_records and valid_records[-1]["nll_loss"] < values[0]

    # The run started from the directory's weights, not from a fresh initialization.
    log_text = "".join(p.read_text() for p in (out / "logs").glob("*"))
    assert f"from {model_dir}" in log_text


def test_the_export_loads_with_from_pretrained_and_computes_the_same_logits(
    tmp_path: Path,
) -> None:
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", sentences(200, seed=0))
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in sentences(200, seed=2)])
    out = tmp_path / "run"
    assert_ok(
        run_here(
            out,
            "model.name=llama_debug",
            f"tokenizer.path={tokenizer_dir}",
            f"data.train={train}",
            "trainer.max_num_steps=4",
            "trainer.checkpoint_every_n_steps=4",
            *TINY_TRAINING,
        )
    )
    # The export command in a process of its own: what it imports, it imports itself.
    destination = tmp_path / "exported"
    result = run_python("-m", "runtime", "export", str(out), str(destination), "--format", "hf")
    assert_ok(result)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in destination.iterdir()
    }

    state = last_model(out)
    config = json.loads((destination / "config.json").read_text())
    model = Llama(
        llama_args(
            "llama_debug",
            vocab_size=config["vocab_size"],
            max_seq_len=config["max_position_embeddings"],
        )
    )
    model.load_state_dict(state)
    exported = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    tokens = torch.randint(0, config["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    assert transformers.PreTrainedTokenizerFast(tokenizer_file=str(destination / "tokenizer.json"))


def test_sft_trains_on_responses_only(tmp_path: Path) -> None:
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", sentences(200, seed=0))
    rng = random.Random(4)
    records: list[dict[str, object]] = [
        {"prompt": " ".join(rng.choice(WORDS) for _ in range(8)), "response": "the cat sat"}
        for _ in range(64)
    ]
    train = write_jsonl(tmp_path / "sft.jsonl", records)
    out = tmp_path / "run"
    assert_ok(
        run_here(
            out,
            "task=sft",
            "model.name=llama_debug",
            f"tokenizer.path={tokenizer_dir}",
            f"data.train={train}",
            "trainer.max_num_steps=24",
            "trainer.checkpoint_every_n_steps=1000",
            *TINY_TRAINING,
        )
    )
    records_out = read_jsonl(out / "metrics" / "train.jsonl")
    # Four examples a step, each with three response words and EOS as its targets.
    assert {int(r["num_targets"]) for r in records_out if "num_targets" in r} == {16}
    values = losses(out)
    assert values[-1] < 0.3 * values[0], values


def kill_9_and_resume(out: Path, config: tuple[str, ...]) -> None:
    """Run the recipe, kill -9 it and its data workers after its first checkpoint, rerun it (in
    this process: nothing kills the rerun)."""
    kill_9_after_first_checkpoint([sys.executable, *recipe_args(out, *config)], out, timeout=240)
    assert_ok(run_here(out, *config))


def test_a_mixture_with_workers_resumes_exactly_after_kill_9(tmp_path: Path) -> None:
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tok", sentences(200, seed=0))
    web = write_jsonl(tmp_path / "web.jsonl", [{"text": s} for s in sentences(300, seed=5)])
    code = write_jsonl(tmp_path / "code.jsonl", [{"text": s} for s in sentences(300, seed=6)])
    config = (
        "model.name=llama_debug",
        f"tokenizer.path={tokenizer_dir}",
        f"data.mixture=[{{path: {web}, weight: 3}}, {{path: {code}, weight: 1}}]",
        "trainer.max_num_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.keep_last_n_checkpoints=null",
        *TINY_TRAINING,
        "data.num_workers=2",
    )
    # The uninterrupted reference goes on beside the killed run and its resume: each is one
    # process, and this machine has a core for each.
    reference, out = tmp_path / "reference", tmp_path / "killed"
    with ThreadPoolExecutor(max_workers=1) as pool:
        uninterrupted = pool.submit(run_python, *recipe_args(reference, *config), timeout=300)
        kill_9_and_resume(out, config)
        assert_ok(uninterrupted.result())
    expected, actual = last_model(reference), last_model(out)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_skipped_bad_lines_are_counted_and_published(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": s}) for s in repeated(100, seed=2)]
    lines[3] = "this line is not JSON"
    lines[7] = json.dumps({"title": "no text field"})
    train.write_text("\n".join(lines) + "\n")
    base = ("model.name=llama_debug", f"data.train={train}", "trainer.max_num_steps=3")
    out = tmp_path / "run"
    assert_ok(run_here(out, *TINY_TRAINING, *base, "data.skip_bad_lines=true"))
    records = read_jsonl(out / "metrics" / "train.jsonl")
    assert records[-1]["num_bad_lines"] == 2

    # Without skip_bad_lines the run fails (with a traceback, in a process) on the first one.
    with pytest.raises(TextDataError, match=r"train\.jsonl: line 4: the line is not JSON"):
        run_here(tmp_path / "strict", *TINY_TRAINING, *base)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        # test_validation checks the same with a transformers Llama under FSDP2 and HSDP in
        # `make test`; these run the recipe's own switches in `make test-all`.
        pytest.param(2, ("data_parallel=fsdp",), id="fsdp2", marks=pytest.mark.slow),
        pytest.param(
            4, ("data_parallel=hsdp", "gang.dp_shard_size=2"), id="hsdp", marks=pytest.mark.slow
        ),
    ],
)
def test_validation_before_the_first_step_leaves_training_intact(
    tmp_path: Path, nproc: int, layout: tuple[str, ...]
) -> None:
    """A Hugging Face Llama on meta, sharded over its decoder layers: a validation before any
    step must not leave FSDP2's parameter buffers unusable for training."""
    model_dir = make_hf_llama_dir(tmp_path / "model")
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(30, seed=2)])
    out = tmp_path / "run"
    result = torchrun(
        nproc,
        *recipe_args(
            out,
            *TINY_TRAINING,
            *layout,
            f"model.hf_path={model_dir}",
            f"data.train={train}",
            f"data.valid={valid}",
            "trainer.validate_at_start=true",
            "trainer.validate_every_n_steps=3",
            "trainer.checkpoint_every_n_steps=3",
            "trainer.max_num_steps=3",
        ),
        timeout=600,
    )
    assert_ok(result)
    assert [r["step_nr"] for r in read_jsonl(out / "metrics" / "valid.jsonl")] == [0, 3]
    assert len(losses(out)) == 3


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_an_uneven_valid_set_scores_under_fsdp_what_it_scores_in_one_process(
    tmp_path: Path, task: str
) -> None:
    """The validation before the first step, from the directory's weights: under FSDP2 on 2
    ranks a rank whose valid shard is empty must still join the other's forwards."""
    from recipes.lm import DataSection, LMConfig, packed_valid_set

    model_dir = make_hf_llama_dir(tmp_path / "model")
    if task == "pretrain":
        train = write_jsonl(tmp_path / "train.jsonl", [{"text": s} for s in repeated(200, seed=2)])
        valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": s} for s in repeated(3, seed=2)])
        # One packed sequence: DP rank 1 reads no valid batch at all.
        config = LMConfig(data=DataSection(valid=str(valid), seq_len=32))
        assert len(packed_valid_set(config, load_tokenizer(model_dir))) == 1
    else:
        rng = random.Random(4)
        records: list[dict[str, object]] = [
            {"prompt": " ".join(rng.choice(WORDS) for _ in range(8)), "response": "the cat sat"}
            for _ in range(9)
        ]
        train = write_jsonl(tmp_path / "train.jsonl", records * 8)
        # 9 examples in batches of 4: DP rank 0 reads two batches, rank 1 one.
        valid = write_jsonl(tmp_path / "valid.jsonl", records)
    config_args = (
        *TINY_TRAINING,
        f"task={task}",
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
        "trainer.validate_at_start=true",
        "trainer.validate_every_n_steps=1",
        "trainer.checkpoint_every_n_steps=1",
        "trainer.max_num_steps=1",
    )
    assert_ok(run_python(*recipe_args(tmp_path / "one", *config_args), timeout=300))
    sharded = recipe_args(tmp_path / "two", *config_args, "data_parallel=fsdp")
    assert_ok(torchrun(2, *sharded, timeout=600))
    one, two = (read_jsonl(tmp_path / run / "metrics" / "valid.jsonl") for run in ("one", "two"))
    assert [r["step_nr"] for r in two] == [0, 1]
    assert two[0]["nll_loss"] == pytest.approx(one[0]["nll_loss"], rel=1e-5)


def test_flops_per_token_count_what_multiplies_and_attention() -> None:
    """6 per multiplying parameter (an embedding's lookup is not one, unless it is tied to the
    output layer), plus 12 * layers * hidden size * seq_len for attention."""
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(10, 4),
            "block": nn.Linear(4, 4),
            "head": nn.Linear(4, 10, bias=False),
        }
    )
    hf = {"num_hidden_layers": 2, "hidden_size": 4}
    attention = 12.0 * 2 * 4 * 16
    assert flops_per_token(model, hf, 16) == 6.0 * (20 + 40) + attention
    model["head"].weight = model["embed"].weight  # tied: one table, and it multiplies
    assert flops_per_token(model, hf, 16) == 6.0 * (20 + 40) + attention


def test_prepared_data_trains_validates_and_is_refused_with_another_tokenizer(
    tmp_path: Path,
) -> None:
    tokenizer_dir = make_tokenizer_dir(tmp_path / "tokenizer", WORDS)
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    for split, seed in (("train", 0), ("valid", 1)):
        text = tmp_path / f"{split}.txt"
        text.write_text("".join(line + "\n" for line in repeated(150, seed=seed)))
        prepare_dataset(tmp_path / split, [text], tokenizer=tokenizer, num_workers=0)
    base = (
        "model.name=llama_debug",
        f"data.train={tmp_path / 'train'}",
        f"data.valid={tmp_path / 'valid'}",
        "trainer.max_num_steps=4",
    )
    out = tmp_path / "run"
    run = run_here(
        out,
        *TINY_TRAINING,
        *base,
        f"tokenizer.path={tokenizer_dir}",
        "trainer.validate_every_n_steps=2",
    )
    assert_ok(run)
    assert len(losses(out)) == 4
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    assert [record["step_nr"] for record in valid] == [2, 4]

    with pytest.raises(ValueError, match="task=sft reads records with their fields"):
        load_config(LMConfig, overrides=[*base, "task=sft"])
    config = load_config(LMConfig, overrides=base)
    with pytest.raises(PreparedDataError, match="tokenized by another tokenizer"):
        build_readers(config, ByteTokenizer(), Gangs.single())
    mixed = [
        *base[:1],
        f"data.mixture=[{{path: {tmp_path / 'train'}}}, {{path: {tmp_path}/train.txt}}]",
    ]
    with pytest.raises(ValueError, match="mixes prepared directories and text files"):
        build_readers(load_config(LMConfig, overrides=mixed), tokenizer, Gangs.single())
