"""The config of ``recipes.lm``: its sections and their checks."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from models.llama import PRESETS
from models.lora import LoraSection
from models.pipeline import hf_pipeline_refusal, split_layers
from recipes.common import (
    FsdpSection,
    GangSection,
    OptimizerSection,
    PipelineSection,
    TrainerSection,
)
from recipes.lm.preference import PreferenceSection
from runtime.cli.config import exactly_one_of
from runtime.data.text import is_prepared_dataset
from trainkit_utils.arguments import check_positive
from units.grpo import GrpoOptions


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
    sp_size: int = 1
    """Sequence parallelism (Ulysses): split every sequence over this many ranks, which read the
    same batches; attention gathers the whole sequence for its share of the heads (1: off).
    The DP size is processes / (sp_size x tp_size); data.seq_len must divide by it."""


@dataclass
class GrpoSection(GrpoOptions):
    """task=grpo: GRPO's options, with TRL's names (:class:`units.grpo.GrpoOptions`), and the
    data's prompt field. data.batch_size counts prompts; each gets num_generations completions."""

    prompt_field: str = "prompt"
    """The record field of the prompt (a string or chat messages); the other fields go to the
    reward functions."""

    def check_task(self, config: LMConfig) -> None:
        if config.task != "grpo":
            default = GrpoSection()
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)
            ]
            if changed:
                raise ValueError(
                    f"grpo.{changed[0]} applies to task=grpo, but the task is {config.task}, "
                    "which ignores it. Set task=grpo, or leave the grpo section out."
                )
            return
        self.check()
        if config.model.hf_path is None:
            raise ValueError(
                "task=grpo generates with a Hugging Face model's generate: give model.hf_path "
                "(the project's model.name models have no KV-cache generation)."
            )
        if config.data.valid is not None:
            raise ValueError(
                "task=grpo has no validation set yet (its metrics are the rollouts' rewards). "
                "Leave data.valid out."
            )
        if config.data.seq_len <= self.max_completion_length:
            raise ValueError(
                f"data.seq_len ({config.data.seq_len}) is the most tokens of a prompt and its "
                f"completion, so it must exceed grpo.max_completion_length "
                f"({self.max_completion_length})."
            )


@dataclass
class LMConfig:
    task: Literal["pretrain", "sft", "dpo", "simpo", "orpo", "cpo", "grpo"] = "pretrain"
    """pretrain: packed text, every token a target; sft: prompt/response pairs, responses only;
    dpo, simpo, orpo, cpo: prompt/chosen/rejected pairs (see docs/preference.md); grpo: prompts,
    completions drawn by the policy and scored by reward functions (see docs/rl.md)."""
    gang: LMGangSection = field(default_factory=LMGangSection)
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=lambda: OptimizerSection(lr=3e-4))
    trainer: TrainerSection = field(default_factory=TrainerSection)
    fsdp: FsdpSection = field(default_factory=FsdpSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
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
        self.grpo.check_task(self)
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
            ("gang.pp_size", self.gang.pp_size),
            ("gang.sp_size", self.gang.sp_size),
        ):
            check_positive(name, value)
        if self.gang.pp_size > 1:
            self._validate_pipeline()
        if self.gang.sp_size > 1:
            self._validate_sequence_parallel()
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

    def _validate_pipeline(self) -> None:
        pp_size = self.gang.pp_size
        if self.task not in ("pretrain", "sft") or self.lora.rank is not None:
            raise ValueError(
                f"gang.pp_size ({pp_size}) trains task=pretrain and task=sft without LoRA, but "
                f"the task is {self.task}{' with lora.rank' if self.lora.rank else ''}. Use "
                "gang.pp_size=1 for it."
            )
        self.pipeline.check(pp_size, self.data.batch_size, compile=self.compile)
        if self.model.hf_path is not None:
            model_type = json.loads((self.model.hf_path / "config.json").read_text()).get(
                "model_type"
            )
            refusal = hf_pipeline_refusal(model_type, "The model of model.hf_path")
            if refusal is not None:
                raise ValueError(refusal)
        num_layers = self._num_layers()
        if num_layers is not None:
            # The same check as the split's, here so that it fails before the launch's work.
            split_layers(num_layers, pp_size * self.pipeline.stages_per_rank, self.pipeline.split)

    def _num_layers(self) -> int | None:
        """The model's decoder layers, as its preset or config.json says (None: unknown)."""
        if self.model.name in PRESETS:
            return PRESETS[self.model.name]["num_layers"]
        if self.model.hf_path is not None:
            config = json.loads((self.model.hf_path / "config.json").read_text())
            # GPT-2's config.json names them n_layer.
            layers = config.get("num_hidden_layers", config.get("n_layer"))
            return layers if isinstance(layers, int) else None
        return None

    def _validate_sequence_parallel(self) -> None:
        sp_size = self.gang.sp_size
        if self.task not in ("pretrain", "sft"):
            raise ValueError(
                f"gang.sp_size ({sp_size}) splits the sequences of task=pretrain or task=sft, "
                f"but task is {self.task}, whose loss needs each sequence whole. Use "
                "gang.sp_size=1."
            )
        if self.task == "pretrain" and self.data.seq_len % sp_size != 0:
            low = self.data.seq_len - self.data.seq_len % sp_size
            options = " or ".join(str(n) for n in (low, low + sp_size) if n > 0)
            raise ValueError(
                f"data.seq_len ({self.data.seq_len}) does not split over gang.sp_size "
                f"({sp_size}): each SP rank keeps seq_len / sp_size positions. Use "
                f"data.seq_len={options}."
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
