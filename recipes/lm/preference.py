"""The sections of ``recipes.lm``'s preference tasks (task=dpo|simpo|orpo|cpo): the method's
options, the data's fields, and which task reads which option."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.data.text import PreferenceFields
from units.preference import PREFERENCE_TASKS, PreferenceOptions, PreferenceTask


@dataclass
class PreferenceSection(PreferenceOptions):
    """task=dpo|simpo|orpo|cpo: the method's options (:class:`units.preference.PreferenceOptions`)
    and the data's fields."""

    precompute_reference: bool = False
    """DPO: compute the reference's log-probabilities of every pair once before training (kept
    under OUTPUT_DIR/reference_logps/), then free the reference: no reference forward per step."""
    prompt_field: str = "prompt"
    """The record field of the prompt (a string or chat messages)."""
    chosen_field: str = "chosen"
    """The record field of the preferred completion."""
    rejected_field: str = "rejected"
    """The record field of the other completion."""

    @property
    def fields(self) -> PreferenceFields:
        return PreferenceFields(self.prompt_field, self.chosen_field, self.rejected_field)

    def check_task(self, task: str) -> None:
        """Refuse every option that ``task`` would ignore: one set away from its default."""
        for option in dataclasses.fields(self):
            value = getattr(self, option.name)
            if value == option.default:
                continue
            tasks = _OPTION_TASKS.get(option.name, PREFERENCE_TASKS)
            if task not in tasks:
                raise ValueError(
                    f"preference.{option.name} applies to task={'|'.join(tasks)}, but the task "
                    f"is {task}, which ignores it. Leave it at its default ({option.default})."
                )
        if self.label_smoothing and task == "dpo" and self.loss_type != "robust":
            raise ValueError(
                "preference.label_smoothing applies to task=dpo with loss_type=robust and to "
                "task=simpo|cpo, but the task is dpo, which ignores it under loss_type "
                f"{self.loss_type}. Set preference.loss_type=robust, or leave label_smoothing "
                "at its default (0.0)."
            )


# The tasks that read each option that not every preference task reads.
_OPTION_TASKS: dict[str, tuple[PreferenceTask, ...]] = {
    "loss_type": ("dpo",),
    "precompute_reference": ("dpo",),
    "label_smoothing": ("dpo", "simpo", "cpo"),
    "simpo_gamma": ("simpo",),
    "cpo_alpha": ("cpo",),
}
