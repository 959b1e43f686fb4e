"""The model families ``recipes.lm`` trains and the layouts it trains them in: one list that the
family tests run and that ``docs/lm-recipe.md``'s table shows (tests/recipes/test_families.py
checks that the two agree).

Each family is a tiny model built from its ``transformers`` config (nothing is downloaded) and
saved as a Hugging Face directory with a word-level tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.conftest import make_tokenizer_dir
from tests.recipes.test_lm import repeated, sentences

SEQ_LEN = 32
STEPS = 8
"""Steps of each matrix run; a checkpoint and a validation every ``STEPS // 2``."""
UNEVEN_VALID = 9
"""Valid sequences: 9 over 2 DP ranks of 4 leaves one rank a batch short at the end."""


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    overrides: tuple[str, ...]
    """Every layout reads 8 sequences a step (DP size x data.batch_size), so their losses agree."""


LAYOUTS = (
    Layout("DDP", 2, ("data_parallel=ddp", "data.batch_size=4")),
    Layout("FSDP2", 2, ("data_parallel=fsdp", "fsdp.param_dtype=bfloat16", "data.batch_size=4")),
    Layout("TP", 2, ("gang.tp_size=2", "data.batch_size=8")),
    Layout(
        "FSDP2 x TP",
        4,
        ("data_parallel=fsdp", "gang.tp_size=2", "fsdp.param_dtype=bfloat16", "data.batch_size=4"),
    ),
)
LAYOUT_BY_NAME = {layout.name: layout for layout in LAYOUTS}

_COMMON: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

NO_TP_PLAN = "no base_model_tp_plan"

_MOE: dict[str, Any] = {"num_experts_per_tok": 2, "tie_word_embeddings": False}
"""Four experts of every family, two per token."""


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[int], Any]
    """The family's tiny ``transformers`` config for a vocabulary size."""
    features: str
    """What the family brings that the others do not."""
    quick_layout: str | None
    """The layout ``make test`` trains it in (the others run in ``make test-all``); None: every
    layout in ``make test-all`` only."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Layouts the recipe refuses at start, and words its one-line error holds."""
    experts: bool = False
    """A mixture of experts: per-expert keys in its files, a router's load-balancing loss."""

    @property
    def slug(self) -> str:
        return self.name.lower().replace("-", "").replace(" ", "")


def _config(class_name: str, **overrides: Any) -> Callable[[int], Any]:
    def make(vocab_size: int) -> Any:
        import transformers

        return getattr(transformers, class_name)(**(_COMMON | overrides), vocab_size=vocab_size)

    return make


def _gpt2(vocab_size: int) -> Any:
    import transformers

    return transformers.GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
    )


FAMILIES = (
    Family(
        "Llama",
        _config("LlamaConfig", tie_word_embeddings=False),
        "grouped-query attention, rotary positions",
        quick_layout="DDP",
    ),
    Family(
        "Mistral",
        _config("MistralConfig", tie_word_embeddings=False, sliding_window=16),
        "sliding-window attention (16 of 32 tokens)",
        quick_layout="FSDP2",
    ),
    Family(
        "Qwen2",
        _config("Qwen2Config", tie_word_embeddings=True),
        "q/k/v biases, tied embeddings",
        quick_layout="FSDP2",
    ),
    Family(
        "Qwen3",
        _config("Qwen3Config", tie_word_embeddings=False, head_dim=8),
        "per-head q/k norms (TP: their gradients summed over the TP ranks)",
        quick_layout="TP",
    ),
    Family(
        "Gemma 2",
        _config("Gemma2Config", tie_word_embeddings=True, head_dim=8, sliding_window=8),
        "tied embeddings, attention and final logit soft-capping (eager attention), "
        "sliding window (8) on every other layer",
        quick_layout="TP",
    ),
    Family(
        "GPT-2",
        _gpt2,
        "Conv1D projections, absolute positions, tied embeddings",
        quick_layout="FSDP2",
        refused={"TP": NO_TP_PLAN, "FSDP2 x TP": NO_TP_PLAN},
    ),
    Family(
        "Phi-3",
        _config("Phi3Config", tie_word_embeddings=False),
        "fused qkv and gate/up projections (TP: outputs gathered)",
        quick_layout="TP",
    ),
    Family(
        "OLMo-2",
        _config("Olmo2Config", tie_word_embeddings=False),
        "q/k norms over the whole width (TP: outputs gathered), norms after each sublayer",
        quick_layout="DDP",
    ),
)
MOE_FAMILIES = (
    Family(
        "Qwen3-MoE",
        _config("Qwen3MoeConfig", **_MOE, num_experts=4, moe_intermediate_size=16, head_dim=8),
        "4 experts, top-2 softmax routing, load-balancing loss (0.001)",
        quick_layout="FSDP2",
        experts=True,
    ),
    Family(
        "Mixtral",
        _config("MixtralConfig", **_MOE, num_local_experts=4, intermediate_size=16),
        "experts stored as block_sparse_moe w1/w2/w3, renamed and merged at load",
        quick_layout=None,
        experts=True,
    ),
    Family(
        "OLMoE",
        _config("OlmoeConfig", **_MOE, num_experts=4, intermediate_size=16),
        "q/k norms over the whole width, load-balancing loss (0.01)",
        quick_layout=None,
        experts=True,
    ),
    Family(
        "Qwen2-MoE",
        _config(
            "Qwen2MoeConfig",
            **_MOE,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
        ),
        "a gated shared expert beside the routed ones",
        quick_layout=None,
        experts=True,
    ),
    Family(
        "DeepSeek-V3",
        _config(
            "DeepseekV3Config",
            **_MOE,
            n_routed_experts=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "sigmoid, group-limited routing with a correction bias (no aux loss), latent "
        "attention, a dense first layer",
        quick_layout=None,
        experts=True,
    ),
)
"""The mixtures of experts whose files hold one tensor per expert (merged at load, split again
at export)."""
GPT_OSS = Family(
    "gpt-oss",
    _config(
        "GptOssConfig",
        **_MOE,
        num_local_experts=4,
        intermediate_size=16,
        head_dim=8,
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "experts with biases and a clamped, interleaved gate; attention sinks; sliding window (16) "
    "on every other layer",
    quick_layout=None,
    refused={"TP": NO_TP_PLAN, "FSDP2 x TP": NO_TP_PLAN},
    experts=True,
)
"""A mixture of experts whose files hold its experts stacked, as the model does (no conversion);
its plan splits nothing but the embedding, which the recipe leaves whole."""
FAMILIES = (*FAMILIES, *MOE_FAMILIES, GPT_OSS)
FAMILY_BY_NAME = {family.name: family for family in FAMILIES}


def cells() -> list[tuple[Family, Layout]]:
    """Every family in every layout, refused ones included."""
    return [(family, layout) for family in FAMILIES for layout in LAYOUTS]


# --------------------------------------------------------------------------------- files


def make_family_dir(family: Family, directory: Path, *, dropout: bool = True) -> Path:
    """The family's tiny model saved here with a word-level tokenizer: a ``model.hf_path``.
    ``dropout=False``: every dropout probability of its config 0 (GPT-2's are 0.1), for runs that
    must equal a run in another layout, which draws other masks."""
    from transformers import AutoModelForCausalLM

    from runtime.data.text import load_tokenizer

    make_tokenizer_dir(directory, sentences(200, seed=0))
    config = family.config(load_tokenizer(directory).vocab_size)
    if not dropout:
        for name, value in vars(config).items():
            if name.endswith(("pdrop", "dropout")) and isinstance(value, float):
                setattr(config, name, 0.0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def write_train(path: Path) -> Path:
    """400 documents drawn from eight sentences: text a tiny model learns in a few steps."""
    return _write_jsonl(path, repeated(400, seed=2))


def write_valid(path: Path, num_sequences: int) -> Path:
    """Documents of the training text that pack into exactly ``num_sequences`` valid sequences
    (each ``SEQ_LEN - 1`` words, BOS and EOS)."""
    words = " ".join(repeated(num_sequences * SEQ_LEN, seed=2)).split()
    width = SEQ_LEN - 1
    return _write_jsonl(
        path, [" ".join(words[i * width : (i + 1) * width]) for i in range(num_sequences)]
    )


def _write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def run_config(model_dir: Path, train: Path, valid: Path, layout: Layout) -> list[str]:
    """The ``--config`` overrides of a matrix run."""
    return [
        f"model.hf_path={model_dir}",
        f"data.train={train}",
        f"data.valid={valid}",
        f"data.seq_len={SEQ_LEN}",
        "data.num_workers=0",
        "model.activation_checkpointing=true",
        "optimizer.lr=0.01",
        "optimizer.warmup_steps=2",
        f"trainer.max_num_steps={STEPS}",
        f"trainer.checkpoint_every_n_steps={STEPS // 2}",
        f"trainer.validate_every_n_steps={STEPS // 2}",
        "trainer.keep_last_n_checkpoints=null",
        "trainer.publish_metrics_every_n_steps=1",
        "trainer.gc_every_n_steps=null",
        # A peak for the CPU, so the runs count their FLOPs and publish mfu as on a GPU.
        "trainer.device_peak_flops=1e12",
        *layout.overrides,
    ]


# --------------------------------------------------------------------------------- docs


def _cell(family: Family, layout: Layout) -> str:
    if layout.name in family.refused:
        return f"refused: {family.refused[layout.name]}"
    return "✓ (make test)" if layout.name == family.quick_layout else "✓"


def markdown_table() -> str:
    """The family-by-layout table of docs/lm-recipe.md."""
    header = ["Family", *(layout.name for layout in LAYOUTS), "What it brings"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in FAMILIES:
        row = [family.name, *(_cell(family, layout) for layout in LAYOUTS), family.features]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
