"""Train or fine-tune a causal language model on your text files.

The model is a Hugging Face causal LM from a local directory (``model.hf_path=DIR``: its
``config.json``, safetensors and ``tokenizer.json``) or the project's own Llama-style model
(``model.name=llama_debug|llama_125m|llama_1b|llama_8b``). The data is JSONL, plain text or Parquet
(``data.train=``, ``data.valid=``, or ``data.mixture=[{path: ..., weight: ...}]``), tokenized in
worker processes and packed into sequences (``task=pretrain``), or prompt/response pairs with the loss
on the responses only (``task=sft``), or preference pairs (``task=dpo|simpo|orpo|cpo``, see
:mod:`recipes.preference`). Run it with
``torchrun --standalone --nproc-per-node 8 -m recipes.lm OUTPUT_DIR --config model.hf_path=DIR
data.train=train.jsonl``; ``python -m runtime export OUTPUT_DIR DEST --format hf`` writes a
Hugging Face directory of the result. ``lora.rank=N`` fine-tunes LoRA adapters instead (peft; see
:mod:`recipes.lora`), which ``--format peft`` exports.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)
from torcheval.metrics import Max, Mean

from gangs import Gangs
from recipes.common import (
    FsdpSection,
    GangSection,
    OptimizerSection,
    TrainerSection,
    adamw_with_schedule,
    logits_and_aux_loss,
    logits_of,
    parallel_options,
    setup_recipe_gangs,
    summed_nll_loss,
    trainer_options,
)
from recipes.expert_load import ExpertBiasUpdate, ExpertLoad, correction_biases
from recipes.experts import apply_expert_parallel, expert_modules, router_aux_loss_coefficient
from recipes.llama import Llama, hf_config, llama_args, tensor_parallel_plan
from recipes.lora import LoraAdapters, LoraSection, apply_lora
from recipes.preference import (
    PREFERENCE_TASKS,
    AdapterBaseReference,
    FrozenReference,
    ModelReference,
    PreferenceEvalUnit,
    PreferenceSection,
    Reference,
    preference_unit,
)
from recipes.reference_logps import (
    Autocast,
    autocast_of,
    compute_reference_logps,
    stored_reference_logps,
)
from runtime import (
    DataReader,
    InitFn,
    MapDataReader,
    SyncMode,
    Trainer,
    load_initial_weights,
    main,
    parallelize_model,
)
from runtime.cli.config import exactly_one_of
from runtime.cli.hf_export import HF_FILES_DIR
from runtime.data.text import (
    InstructionDataset,
    InstructionFields,
    PreferenceDataset,
    PreparedDataReader,
    TextBatch,
    TextDataReader,
    TextSource,
    Tokenizer,
    collate_instructions,
    collate_preference_pairs,
    is_prepared_dataset,
    load_tokenizer,
    parse_mixture,
)
from runtime.parallel.wrapping import unwrap_model
from trainkit_utils.arguments import check_positive
from units import EvalUnit, TrainUnit

log = logging.getLogger(__name__)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---------------------------------------------------------------------------- config


@dataclass
class ModelSection:
    hf_path: Path | None = field(default=None, metadata=exactly_one_of("model"))
    """A Hugging Face causal LM directory: built from its config.json, loaded from its weights."""
    name: str | None = field(default=None, metadata=exactly_one_of("model"))
    """The project's Llama-style model: llama_debug, llama_125m, llama_1b or llama_8b."""
    from_scratch: bool = False
    """With hf_path: train from the model's own initialization instead of the directory's weights."""
    activation_checkpointing: bool = False
    """Recompute the layers' activations in the backward pass: less memory, more compute."""
    activation_checkpointing_every_n: int = 1
    """With activation_checkpointing: checkpoint every n-th layer only."""
    expert_bias_update_rate: float | None = None
    """A mixture of experts whose routers have a correction bias (DeepSeek-V3): move it by this
    much a step towards balanced experts (aux-loss-free load balancing; 1e-3 is usual)."""


@dataclass
class TokenizerSection:
    path: Path | None = None
    """A tokenizer.json (or its directory); default: model.hf_path's, else UTF-8 bytes."""


@dataclass
class DataSection:
    train: str | None = field(default=None, metadata=exactly_one_of("train"))
    """Training files: a path, directory or glob of .jsonl, .txt or .parquet files, or a
    prepared dataset's directory (python -m runtime prepare)."""
    valid: str | None = None
    """Validation files, given as data.train is (null: no validation)."""
    mixture: list[dict[str, Any]] | None = field(default=None, metadata=exactly_one_of("train"))
    """Instead of train: [{path: ..., weight: ...}, ...], sampled by weight (all files, or
    all prepared directories)."""
    text_field: str = "text"
    """The field of a .jsonl or .parquet record that holds the text."""
    seq_len: int = 512
    """Tokens per sequence (the context length)."""
    batch_size: int = 8
    """Sequences per micro-batch on each DP rank."""
    num_accumulate: int = 1
    """Micro-batches whose gradients add up to one optimizer step."""
    num_workers: int = 2
    """Processes that read and tokenize the training files (0: in the training process)."""
    document_mask: bool = False
    """Keep attention inside each packed document (the project's Llama model only)."""
    skip_bad_lines: bool = False
    """Skip and count unreadable records instead of failing."""
    prompt_field: str = "prompt"
    """task=sft: the field that holds the prompt."""
    response_field: str = "response"
    """task=sft: the field that holds the response, the targets."""
    messages_field: str | None = None
    """task=sft: a chat messages field, rendered with the tokenizer's chat template."""
    bucket_size: int = 1024
    """task=sft: examples sorted by length within windows of this many, to pad little."""


@dataclass
class LMGangSection(GangSection):
    ep_size: int = 1
    """Expert parallelism: split each MoE layer's experts over this many DP ranks (1: off)."""


@dataclass
class LMConfig:
    task: Literal["pretrain", "sft", "dpo", "simpo", "orpo", "cpo"] = "pretrain"
    """pretrain: packed text, every token a target; sft: prompt/response pairs, responses only;
    dpo, simpo, orpo, cpo: prompt/chosen/rejected pairs (see docs/preference.md)."""
    gang: LMGangSection = field(default_factory=LMGangSection)
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=lambda: OptimizerSection(lr=3e-4))
    trainer: TrainerSection = field(default_factory=TrainerSection)
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    data_parallel: Literal["auto", "ddp", "fsdp", "hsdp"] = "auto"
    """auto: HSDP with gang.dp_shard_size, else FSDP2 with TP, else DDP."""
    compile: bool = False
    """torch.compile each decoder layer."""
    init_from: Path | None = None
    """Start from these weights instead (an export file, a run, or a step_N directory)."""
    wandb_project: str | None = None
    """Also publish the metrics to this Weights & Biases project."""

    def validate(self) -> None:
        # The loader has checked that exactly one of each exactly_one_of group is set.
        model = self.model
        if model.hf_path is not None and not (model.hf_path / "config.json").is_file():
            raise ValueError(
                f"model.hf_path must be a Hugging Face model directory with a config.json, but "
                f"{model.hf_path} has none."
            )
        if self.task != "pretrain" and self.data.mixture is not None:
            raise ValueError(
                f"task={self.task} reads one dataset: give data.train, not data.mixture."
            )
        self.preference.check_task(self.task)
        prepared = [
            path
            for path in (self.data.train, self.data.valid)
            if path and is_prepared_dataset(path)
        ]
        if self.task != "pretrain" and prepared:
            raise ValueError(
                f"task={self.task} reads records with their fields, but {prepared[0]} is a "
                "prepared dataset of packed text (for task=pretrain). Give the .jsonl or "
                ".parquet files."
            )
        for name, value in (
            ("data.seq_len", self.data.seq_len),
            ("data.batch_size", self.data.batch_size),
            ("gang.tp_size", self.gang.tp_size),
            ("gang.ep_size", self.gang.ep_size),
        ):
            check_positive(name, value)
        if self.lora.rank is not None:
            self._validate_lora()
        if self.gang.ep_size > 1 and model.hf_path is None:
            raise ValueError(
                f"gang.ep_size ({self.gang.ep_size}) splits the experts of a Hugging Face "
                "mixture of experts (model.hf_path) over DP ranks, but the project's models "
                "have no experts. Use gang.ep_size=1."
            )
        if self.data.document_mask and (model.hf_path is not None or self.task != "pretrain"):
            raise ValueError(
                "data.document_mask needs the project's model (model.name) and task=pretrain: a "
                "Hugging Face model gets no per-document mask here. Leave document_mask false."
            )

    def _validate_lora(self) -> None:
        check_positive("lora.rank", self.lora.rank)
        if self.model.hf_path is None or self.model.from_scratch:
            raise ValueError(
                "lora.rank adapts the weights of a Hugging Face model: give model.hf_path (and "
                "leave model.from_scratch false), or drop lora.rank to train every weight."
            )
        if self.gang.tp_size > 1:
            raise ValueError(
                f"lora.rank trains under DDP and FSDP2/HSDP, not tensor parallelism, but "
                f"gang.tp_size is {self.gang.tp_size}. Use gang.tp_size=1 (with "
                "data_parallel=fsdp to shard the model)."
            )
        if not self.lora.target_modules:
            raise ValueError(
                "lora.target_modules is empty. Name the layers to adapt, e.g. [q_proj, v_proj]."
            )
        if importlib.util.find_spec("peft") is None:
            raise ValueError(
                "lora.rank needs the peft package, which is not installed. Install it with "
                "pip install 'trainkit[lora]' (or pip install peft)."
            )


# ----------------------------------------------------------------------------- data


def load_recipe_tokenizer(config: LMConfig) -> Tokenizer:
    path = config.tokenizer.path
    hf_path = config.model.hf_path
    if path is None and hf_path is not None and (hf_path / "tokenizer.json").is_file():
        path = hf_path
    return load_tokenizer(path)


def build_readers(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, preference: PreferenceData | None = None
) -> tuple[DataReader[Any], DataReader[Any] | None]:
    """The train and valid readers; ``preference``: the pairs of a preference task, if read
    already."""
    data, seed = config.data, config.trainer.seed
    if config.task in PREFERENCE_TASKS:
        pairs = preference or preference_data(config, tokenizer)
        return _preference_reader(config, tokenizer, gangs, pairs.train, train=True), (
            _preference_reader(config, tokenizer, gangs, pairs.valid, train=False)
            if pairs.valid is not None
            else None
        )
    if config.task == "sft":
        return _sft_reader(config, tokenizer, gangs, data.train, train=True), (
            _sft_reader(config, tokenizer, gangs, data.valid, train=False) if data.valid else None
        )
    sources = (
        parse_mixture(data.mixture) if data.mixture is not None else [TextSource(str(data.train))]
    )
    # What both readers take; the on-the-fly one also reads and tokenizes the files.
    packing: dict[str, Any] = {
        "tokenizer": tokenizer,
        "seq_len": data.seq_len,
        "batch_size": data.batch_size,
        "gang": gangs.dp,
        "document_ids": data.document_mask,
    }
    train: DataReader[Any]
    if _all_prepared(sources):
        train = PreparedDataReader(
            sources=sources, num_accumulate=data.num_accumulate, seed=seed, **packing
        )
    else:
        train = TextDataReader(
            sources=sources,
            num_accumulate=data.num_accumulate,
            seed=seed,
            num_workers=data.num_workers,
            text_field=data.text_field,
            skip_bad_lines=data.skip_bad_lines,
            **packing,
        )
    if data.valid is None:
        return train, None
    if is_prepared_dataset(data.valid):
        return train, PreparedDataReader(sources=data.valid, **packing).for_evaluation()
    valid = MapDataReader(
        dataset=packed_valid_set(config, tokenizer),
        batch_size=data.batch_size,
        collate=collate_text_batches,
        gang=gangs.dp,
        shuffle=False,
        drop_remainder=False,
        sync_mode=SyncMode.UNTIL_LAST,
    )
    return train, valid


def _all_prepared(sources: list[TextSource]) -> bool:
    """Whether the datasets are prepared directories; refuses a mixture of both kinds."""
    prepared = [is_prepared_dataset(path) for source in sources for path in source.paths]
    if any(prepared) and not all(prepared):
        raise ValueError(
            "data.mixture mixes prepared directories and text files. Prepare every dataset "
            "(python -m runtime prepare), or give text files only."
        )
    return all(prepared)


def packed_valid_set(config: LMConfig, tokenizer: Tokenizer) -> list[TextBatch]:
    """The valid files packed once, in file order, into sequences of one row each: every rank
    holds them all and the reader shards them, so the score covers every full sequence (only
    the tokens after the last one are left out)."""
    data = config.data
    assert data.valid is not None
    reader = TextDataReader(
        sources=data.valid,
        tokenizer=tokenizer,
        seq_len=data.seq_len,
        batch_size=1,
        gang=Gangs.single().dp,
        text_field=data.text_field,
        skip_bad_lines=data.skip_bad_lines,
        document_ids=data.document_mask,
        shuffle_files=False,
    )
    try:
        rows = [batch for batches in reader for batch in batches]
    finally:
        reader.close()
    if not rows:
        raise ValueError(
            f"data.valid ({data.valid}) holds fewer than data.seq_len + 1 ({data.seq_len + 1}) "
            "tokens: not one sequence to validate on."
        )
    return rows


def collate_text_batches(rows: list[TextBatch]) -> TextBatch:
    def cat(name: str) -> Tensor | None:
        parts = [getattr(row, name) for row in rows]
        return None if parts[0] is None else torch.cat(parts)

    input_ids, target_ids = cat("input_ids"), cat("target_ids")
    assert input_ids is not None and target_ids is not None
    return TextBatch(
        input_ids=input_ids,
        target_ids=target_ids,
        num_targets=sum(row.num_targets for row in rows),
        document_ids=cat("document_ids"),
        positions=cat("positions"),
    )


def _sft_reader(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, path: str | None, *, train: bool
) -> DataReader[Any]:
    data = config.data
    assert path is not None
    dataset = InstructionDataset(
        path,
        tokenizer=tokenizer,
        max_len=data.seq_len,
        fields=InstructionFields(
            prompt=data.prompt_field, response=data.response_field, messages=data.messages_field
        ),
        seed=config.trainer.seed,
        bucket_size=data.bucket_size,
        skip_bad_lines=data.skip_bad_lines,
    )
    # The dataset's own order already groups similar lengths; a reader shuffle would undo it.
    return MapDataReader(
        dataset=dataset,
        batch_size=data.batch_size,
        collate=partial(collate_instructions, pad_id=tokenizer.eos_id),
        gang=gangs.dp,
        num_accumulate=data.num_accumulate if train else 1,
        shuffle=False,
        drop_remainder=train,
        sync_mode=SyncMode.UNTIL_FIRST if train else SyncMode.UNTIL_LAST,
    )


@dataclass
class PreferenceData:
    train: PreferenceDataset
    valid: PreferenceDataset | None


def preference_data(config: LMConfig, tokenizer: Tokenizer) -> PreferenceData:
    """The pairs of data.train and data.valid."""
    data = config.data

    def dataset(path: str) -> PreferenceDataset:
        return PreferenceDataset(
            path,
            tokenizer=tokenizer,
            max_len=data.seq_len,
            fields=config.preference.fields,
            seed=config.trainer.seed,
            bucket_size=data.bucket_size,
            skip_bad_lines=data.skip_bad_lines,
        )

    assert data.train is not None
    return PreferenceData(dataset(data.train), dataset(data.valid) if data.valid else None)


def _preference_reader(
    config: LMConfig, tokenizer: Tokenizer, gangs: Gangs, dataset: PreferenceDataset, *, train: bool
) -> DataReader[Any]:
    data = config.data
    collate = partial(
        collate_preference_pairs,
        pad_id=tokenizer.eos_id,
        num_bad_lines=dataset.num_bad_lines,
        num_dropped=dataset.num_dropped,
    )
    # As _sft_reader: the dataset's order groups similar lengths; the valid set is read whole,
    # every pair once, whatever the number of ranks.
    return MapDataReader(
        dataset=dataset,
        batch_size=data.batch_size,
        collate=collate,
        gang=gangs.dp,
        num_accumulate=data.num_accumulate if train else 1,
        shuffle=False,
        drop_remainder=train,
        sync_mode=SyncMode.UNTIL_FIRST if train else SyncMode.UNTIL_LAST,
    )


# ----------------------------------------------------------------------------- units


class TokenBatch(Protocol):
    input_ids: Tensor
    target_ids: Tensor
    num_targets: int


class LMTrainUnit(TrainUnit[TokenBatch]):
    """The summed cross entropy; for a mixture of experts, plus its load-balancing loss
    (``router_aux_loss_coef``, see :mod:`recipes.experts`), published as ``router_aux_loss``,
    and its experts' load (:mod:`recipes.expert_load`)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean(), persistent=False)
        self.metric_bag.register_metric("num_bad_lines", Max(), persistent=False)
        self.aux_loss_coefficient = router_aux_loss_coefficient(model)
        if self.aux_loss_coefficient:
            self.metric_bag.register_metric("router_aux_loss", Mean(), persistent=False)
        experts = expert_modules(unwrap_model(model))
        self.expert_load = ExpertLoad(experts) if experts else None
        if self.expert_load is not None:
            self.expert_load.register(self.metric_bag)

    def __call__(self, batch: TokenBatch) -> tuple[Tensor, int | None]:
        # The reader's count of skipped lines (data.skip_bad_lines), published with the metrics.
        self.metric_bag.num_bad_lines.update(torch.tensor(getattr(batch, "num_bad_lines", 0)))
        if self.expert_load is not None:
            self.expert_load.begin()
        logits, aux_loss = logits_and_aux_loss(
            self.model, batch, router_logits=self.aux_loss_coefficient > 0
        )
        if self.expert_load is not None:
            self.expert_load.record()
        loss = summed_nll_loss(logits, batch.target_ids)
        # A micro-batch of an SFT run may hold no response token; its mean is left out.
        weight = max(batch.num_targets, 1)
        self.metric_bag.nll_loss.update(loss.detach() / weight, weight=batch.num_targets)
        if aux_loss is not None:
            # The model's mean load-balancing loss, weighted like a mean over the targets:
            # the Trainer divides the sum by the step's targets.
            loss = loss + self.aux_loss_coefficient * batch.num_targets * aux_loss.float()
            self.metric_bag.router_aux_loss.update(aux_loss.detach(), weight=batch.num_targets)
        return loss, batch.num_targets


class LMEvalUnit(EvalUnit[TokenBatch]):
    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.metric_bag.register_metric("nll_loss", Mean())

    def __call__(self, batch: TokenBatch) -> None:
        if batch.num_targets == 0:
            return
        loss = summed_nll_loss(logits_of(self.model, batch), batch.target_ids)
        self.metric_bag.nll_loss.update(loss / batch.num_targets, weight=batch.num_targets)


# ----------------------------------------------------------------------------- model


@dataclass
class BuiltModel:
    model: nn.Module
    block_types: tuple[type[nn.Module], ...]
    flops_per_token: float
    hf_config: dict[str, Any]
    lora: LoraAdapters | None = None


def build_model(
    config: LMConfig, gangs: Gangs, tokenizer: Tokenizer, *, frozen: bool = False
) -> BuiltModel:
    """Build on meta, then shard, wrap and initialize (``parallelize_model``); tied input and
    output embeddings stay one weight in every layout. ``frozen``: no parameter requires a
    gradient (a reference model), no LoRA and no DDP wrapper."""
    if config.model.hf_path is not None:
        model, init_fn, plan, hf = _hf_model(config.model.hf_path, tp=gangs.tp.size > 1)
    else:
        assert config.model.name is not None
        args = llama_args(
            config.model.name, vocab_size=tokenizer.vocab_size, max_seq_len=config.data.seq_len
        )
        with torch.device("meta"):
            model = Llama(args)
        init_fn, plan = model.init_module, tensor_parallel_plan(model)
        hf = hf_config(args, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    block_types = _block_types(model)
    if gangs.tp.size > 1 and not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor parallel plan (its config has no "
            f"base_model_tp_plan that splits a layer), but gang.tp_size is {gangs.tp.size}. "
            "Use gang.tp_size=1: DDP, FSDP2 and HSDP train it."
        )
    lora = None
    if frozen:
        model.requires_grad_(False)
    elif config.lora.rank is not None:
        lora, init_fn = apply_lora(model, config.lora, init_fn)
    flops = flops_per_token(model, hf, config.data.seq_len)
    expert_params = apply_expert_parallel(model, gangs)
    model = parallelize_model(
        model,
        gangs,
        **parallel_options(config, gangs),
        block_types=block_types,
        tp_plan=plan,
        init_fn=init_fn,
        expert_params=expert_params,
    )
    return BuiltModel(model, block_types, flops, hf, lora)


def flops_per_token(model: nn.Module, hf: Mapping[str, Any], seq_len: int) -> float:
    """Forward and backward FLOPs per token, as PaLM (appendix B) and torchtitan count them:
    6 per parameter that multiplies (an embedding's lookup does not; tied to the output layer,
    it does; of a mixture of experts, only the top-k experts a token is routed to), plus
    attention's scores and weighted sum, 12 * layers * hidden size * seq_len.

    Counted on the model before it is wrapped or sharded (the whole parameters)."""
    # A transformers model's config names depth and width alike in every family (GPT-2's
    # config.json says n_layer and n_embd); the recipe's own model has only ``hf``.
    sizes = getattr(model, "config", None) or SimpleNamespace(**hf)
    multiplying = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - multiplying
    num_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    # A token meets only the experts it is routed to: top-k of each layer's experts.
    for _, experts in expert_modules(model):
        share = getattr(sizes, "num_experts_per_tok", 1) / experts.gate_up_proj.shape[0]
        stacked = experts.gate_up_proj.numel() + experts.down_proj.numel()
        num_params -= round(stacked * (1 - share))
    attention = 12.0 * sizes.num_hidden_layers * sizes.hidden_size * seq_len
    return 6.0 * num_params + attention


def _hf_model(
    path: Path, *, tp: bool
) -> tuple[nn.Module, Any, dict[str, ParallelStyle], dict[str, Any]]:
    """The model on meta, its init function, its TP plan (with ``tp``) and its config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config_object = AutoConfig.from_pretrained(path)
    # Training keeps no key/value cache: activation checkpointing's recomputation would append
    # to it a second time (a sliding-window cache then outgrows its mask).
    hf_config_object.use_cache = False
    with torch.device("meta"):
        # transformers picks SDPA where the model supports it, eager attention otherwise (Gemma 2's
        # soft-capped attention logits).
        model = AutoModelForCausalLM.from_config(hf_config_object)

    plan = _hf_tensor_parallel_plan(model, hf_config_object) if tp else {}
    return model, _hf_init_fn(model), plan, json.loads((path / "config.json").read_text())


def _hf_init_fn(model: Any) -> InitFn:
    """A module initialized as ``transformers`` initializes it: its own ``_init_weights``, then its
    ancestors' (children first, as ``initialize_weights`` goes), since a parent may set its
    children's tensors (GPT-2 scales its residual projections by depth)."""
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}

    def init_fn(name: str, module: nn.Module) -> None:
        model._init_weights(module)
        ancestors, node = [], module
        while id(node) in parents:
            node = parents[id(node)]
            ancestors.append(node)
        # The ancestors must set only this module's tensors: every other one is marked
        # initialized for them, as transformers marks the weights it loaded.
        own = {id(t) for t in chain(module.parameters(recurse=False), module.buffers(False))}
        marked = [
            t
            for t in chain(model.parameters(), model.buffers())
            if id(t) not in own and not getattr(t, "_is_hf_initialized", False)
        ]
        for tensor in marked:
            tensor._is_hf_initialized = True  # type: ignore[attr-defined]
        try:
            for ancestor in ancestors:
                model._init_weights(ancestor)
        finally:
            for tensor in marked:
                del tensor._is_hf_initialized  # type: ignore[attr-defined]

    return init_fn


_HF_TP_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    # Fused projections (Phi-3's qkv_proj) and projections a full-width norm follows (OLMo-2):
    # the output is gathered, and the next rowwise layer takes the whole input and splits it.
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    # A per-head norm (Qwen3's q_norm and k_norm) sees this rank's heads only: its weight becomes
    # a replicated DTensor and its input one sharded over the heads, so the weight's gradient is
    # summed over the TP ranks.
    "replicated_with_grad_allreduce": lambda: SequenceParallel(
        sequence_dim=-2, use_local_output=True
    ),
}
# Styles that leave the module whole on every rank: nothing to do.
_HF_TP_UNSPLIT = frozenset({"replicate", "embedding_rowwise", "embedding_colwise"})


def _hf_tensor_parallel_plan(model: nn.Module, hf_config_object: Any) -> dict[str, ParallelStyle]:
    """The config's ``base_model_tp_plan`` as torch's parallel styles; empty without one."""
    plan: dict[str, ParallelStyle] = {}
    prefix = getattr(model, "base_model_prefix", "model")
    for pattern, style in (getattr(hf_config_object, "base_model_tp_plan", None) or {}).items():
        # The stacked experts of a mixture stay whole over TP: each TP rank runs them on its
        # (replicated) tokens, and expert parallelism splits them over the DP ranks instead.
        # (transformers' "packed_colwise" splits the gate and up halves of one tensor apart,
        # which no public parallel style does.)
        if style in _HF_TP_UNSPLIT or "experts" in pattern.split("."):
            continue
        if style not in _HF_TP_STYLES:
            raise ValueError(
                f"{type(model).__name__}'s base_model_tp_plan splits {pattern} as '{style}', which "
                f"this recipe cannot do (it knows {', '.join(sorted(_HF_TP_STYLES))}). "
                "Use gang.tp_size=1: DDP, FSDP2 and HSDP train it."
            )
        for i in range(hf_config_object.num_hidden_layers):
            plan[f"{prefix}.{pattern.replace('*', str(i))}"] = _HF_TP_STYLES[style]()
    return plan


def _block_types(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The decoder layer class: FSDP2's unit, checkpointed and compiled one at a time."""
    if isinstance(model, Llama):
        from recipes.llama import DecoderLayer

        return (DecoderLayer,)
    names = set(getattr(model, "_no_split_modules", None) or ())
    types = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not types:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules), so it "
            "cannot be sharded layer by layer."
        )
    return types


def bias_update(rate: float, unit: TrainUnit[Any], gangs: Gangs) -> ExpertBiasUpdate:
    """The aux-loss-free load balancing of ``model.expert_bias_update_rate``."""
    if not isinstance(unit, LMTrainUnit):
        raise ValueError(
            f"model.expert_bias_update_rate ({rate}) balances the experts of task=pretrain or "
            "task=sft runs. Leave it unset (null) for a preference task."
        )
    biases = correction_biases(unwrap_model(unit.model))
    if unit.expert_load is None or not biases:
        raise ValueError(
            f"model.expert_bias_update_rate ({rate}) moves the correction bias of a mixture of "
            f"experts' routers (DeepSeek-V3's), but {type(unwrap_model(unit.model)).__name__} "
            "has none. Leave it unset (null)."
        )
    return ExpertBiasUpdate(unit.expert_load, biases, gangs.dp, rate)


def write_hf_files(config: LMConfig, hf: dict[str, Any], tokenizer: Tokenizer, out: Path) -> None:
    """Rank 0 keeps the model's config.json and tokenizer files under OUTPUT_DIR, for export."""
    target = out / HF_FILES_DIR
    partial_dir = out / f"{HF_FILES_DIR}.partial"
    shutil.rmtree(partial_dir, ignore_errors=True)
    partial_dir.mkdir(parents=True)
    (partial_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tokenizer_path = getattr(tokenizer, "path", None)
    if tokenizer_path is not None:
        for name in _TOKENIZER_FILES:
            source = Path(tokenizer_path).parent / name
            if source.is_file():
                shutil.copy2(source, partial_dir / name)
    if config.model.hf_path is not None:
        source = config.model.hf_path / "generation_config.json"
        if source.is_file():
            shutil.copy2(source, partial_dir / source.name)
    shutil.rmtree(target, ignore_errors=True)
    partial_dir.replace(target)


def build_units(
    config: LMConfig,
    gangs: Gangs,
    tokenizer: Tokenizer,
    built: BuiltModel,
    init_from: Path | None,
    *,
    precompute: PrecomputeContext | None = None,
) -> tuple[TrainUnit[Any], EvalUnit[Any] | None]:
    """The task's train unit and the eval unit of its valid set (None when precomputed values
    exist for no valid set). ``precompute``: what ``preference.precompute_reference`` needs."""
    if config.task not in PREFERENCE_TASKS:
        return LMTrainUnit(built.model), LMEvalUnit(built.model)
    if config.task != "dpo":
        unit = preference_unit(config.task, built.model, config.preference, None)
        return unit, PreferenceEvalUnit(unit)

    def make_reference() -> Reference:
        return build_reference(config, gangs, tokenizer, built, init_from)

    if config.preference.precompute_reference:
        if precompute is None:
            raise ValueError("preference.precompute_reference needs the datasets and OUTPUT_DIR.")
        reference, valid_reference = precompute.references(config, gangs, built, make_reference)
    else:
        reference = valid_reference = make_reference()
    unit = preference_unit(config.task, built.model, config.preference, reference)
    if valid_reference is None:
        # No valid set: nothing was precomputed for one, and no eval unit will run.
        return unit, None
    valid_unit = preference_unit(config.task, built.model, config.preference, valid_reference)
    return unit, PreferenceEvalUnit(valid_unit)


@dataclass
class PrecomputeContext:
    """What precomputing the reference's log-probabilities takes besides the config."""

    data: PreferenceData
    output_dir: Path
    init_from: Path | None
    autocast: Autocast
    pad_id: int

    def references(
        self,
        config: LMConfig,
        gangs: Gangs,
        built: BuiltModel,
        make_reference: Callable[[], Reference],
    ) -> tuple[Reference, Reference | None]:
        """The train and valid sets' stored log-probabilities, or those computed with the
        reference ``make_reference`` builds (only if needed; freed afterwards)."""
        made: list[Reference] = []

        def model_reference() -> ModelReference:
            if not made:
                if built.lora is not None and self.init_from is not None:
                    # The pass runs before the Trainer loads the base weights: load them now.
                    base = built.lora.trainer_options(self.init_from)["init_from"]
                    load_initial_weights(built.model, base, gangs=gangs)
                made.append(make_reference())
            reference = made[0]
            assert isinstance(reference, ModelReference)
            return reference

        # What the values depend on besides the pairs: the weights and the precision.
        source = (
            f"{self.init_from or f'seed {config.trainer.seed}'}|{config.model}|{config.fsdp}|"
            f"{config.trainer.dtype}|{config.trainer.amp}"
        )

        def stored(name: str, dataset: PreferenceDataset) -> Reference:
            def compute() -> Tensor:
                return compute_reference_logps(
                    model_reference(),
                    dataset,
                    gangs=gangs,
                    batch_size=config.data.batch_size,
                    pad_id=self.pad_id,
                    autocast=self.autocast,
                )

            path = self.output_dir / "reference_logps" / f"{name}.pt"
            return stored_reference_logps(
                path, dataset, source=source, gangs=gangs, compute=compute
            )

        valid = self.data.valid
        references = stored("train", self.data.train), stored("valid", valid) if valid else None
        made.clear()
        return references


def build_reference(
    config: LMConfig, gangs: Gangs, tokenizer: Tokenizer, built: BuiltModel, init_from: Path | None
) -> Reference:
    """DPO's reference. Under LoRA, the policy with its adapters disabled. Otherwise a frozen
    model built, sharded and placed as the policy is (same layout, device, FSDP2 dtypes), with
    the policy's initial weights: loaded from ``init_from`` (or model.hf_path), else
    initialized from the same seed. Checkpoints do not hold it; a resumed run builds it again."""
    if built.lora is not None:
        return AdapterBaseReference(built.model)
    reference = build_model(config, gangs, tokenizer, frozen=True).model
    if init_from is not None:
        load_initial_weights(reference, init_from, gangs=gangs)
    return FrozenReference(reference)


# ---------------------------------------------------------------------------- recipe


def recipe(config: LMConfig, output_dir: Path) -> Trainer[Any]:
    gangs = setup_recipe_gangs(config)
    return build_trainer(config, output_dir, gangs)


def build_trainer(config: LMConfig, output_dir: Path, gangs: Gangs) -> Trainer[Any]:
    """The recipe's Trainer on gangs already made (``config.gang`` must describe them)."""
    tokenizer = load_recipe_tokenizer(config)
    built = build_model(config, gangs, tokenizer)
    num_params = sum(p.numel() for p in built.model.parameters())
    log.info("Model: %s, %d parameters.", type(built.model).__name__, num_params)
    if gangs.root.rank == 0:
        write_hf_files(config, built.hf_config, tokenizer, output_dir)
    pairs = preference_data(config, tokenizer) if config.task in PREFERENCE_TASKS else None
    train_reader, valid_reader = build_readers(config, tokenizer, gangs, pairs)
    optimizer, lr_scheduler = adamw_with_schedule(
        built.model, config.optimizer, max_num_steps=config.trainer.max_num_steps
    )
    init_from = config.init_from
    if init_from is None and config.model.hf_path is not None and not config.model.from_scratch:
        init_from = config.model.hf_path
    options = trainer_options(
        config.trainer,
        output_dir=output_dir,
        gangs=gangs,
        wandb_project=config.wandb_project,
        init_from=init_from,
        flops_per_target=lambda: built.flops_per_token,
        validates=valid_reader is not None,
    )
    if built.lora is not None:
        assert init_from is not None  # LMConfig.validate: LoRA needs the base's weights
        options |= built.lora.trainer_options(init_from)
        if gangs.root.rank == 0:
            built.lora.write_adapter_config(init_from, output_dir)
    precompute = None
    if pairs is not None:
        autocast = autocast_of(gangs.root.device, options["dtype"], options["amp"])
        precompute = PrecomputeContext(pairs, output_dir, init_from, autocast, tokenizer.eos_id)
    train_unit, valid_unit = build_units(
        config, gangs, tokenizer, built, init_from, precompute=precompute
    )
    if config.task in PREFERENCE_TASKS and valid_reader is not None:
        options["score_metric_name"] = "loss"
    if config.model.expert_bias_update_rate is not None:
        options["callbacks"] = [
            bias_update(config.model.expert_bias_update_rate, train_unit, gangs)
        ]
    return Trainer(
        unit=train_unit,
        data_reader=train_reader,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        valid_units=[valid_unit] if valid_unit is not None and valid_reader is not None else [],
        valid_data_readers=[valid_reader] if valid_reader is not None else [],
        **options,
    )


if __name__ == "__main__":
    main(recipe, LMConfig)
