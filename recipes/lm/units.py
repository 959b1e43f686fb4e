"""The units of ``recipes.lm``'s tasks: next-token for pretrain and SFT (with a mixture of
experts' aux loss and load metrics), and the preference family with DPO's reference: a frozen
model built as the policy, the base under LoRA, or log-probabilities computed once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from gangs import Gangs
from models.moe import MoeLMTrainUnit, is_mixture_of_experts
from recipes.lm.config import LMConfig
from recipes.lm.data import PreferenceData
from recipes.lm.model import BuiltModel, build_model, lora_trainer_options
from runtime import load_initial_weights
from runtime.data.text import PreferenceDataset, Tokenizer
from runtime.data.text.reference_logps import (
    Autocast,
    compute_reference_logps,
    stored_reference_logps,
)
from units import EvalUnit, TrainUnit
from units.lm import LMEvalUnit, LMTrainUnit
from units.preference import PREFERENCE_TASKS, PreferenceEvalUnit, preference_unit
from units.reference import AdapterBaseReference, FrozenReference, ModelReference, Reference


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
        pp_gang = gangs.pp if built.pipeline is not None else None
        moe = is_mixture_of_experts(built.model, pp_gang)
        unit = MoeLMTrainUnit(built.model, pp_gang=pp_gang) if moe else LMTrainUnit(built.model)
        return unit, LMEvalUnit(built.model)
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
                    base = lora_trainer_options(built.lora, self.init_from)["init_from"]
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
