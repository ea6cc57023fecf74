"""PipelineTrainer's settings as ART 0.5.23 groups them: `pipeline=PipelineRuntimeConfig(...)` for the rollout
workers, batch sizes and queue, `autotune=PipelineAutotuneConfig(...)` for ART's online tuner of those.

Why a module of its own: ART moved the four pipeline keywords (`num_rollout_workers`, `min_batch_size`,
`max_batch_size`, `queue_maxsize`) into `PipelineRuntimeConfig` and deprecated them as keywords. artnb takes both
spellings and resolves them here, once, into one PipelineRuntimeConfig; giving a setting both ways is an error,
since which one should win is the user's call. artnb has no autotuner: a config that turns it on is accepted and
reported once, and the pipeline runs with the runtime config's settings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .ignored import report_ignored

PIPELINE_KEYWORDS = ("num_rollout_workers", "min_batch_size", "max_batch_size", "queue_maxsize")


class PipelineRuntimeConfig(BaseModel):
    """How many rollouts run at once, how many finished groups make a step, and how many may wait."""

    model_config = ConfigDict(extra="forbid")

    num_rollout_workers: int = Field(default=16, ge=1, description="rollouts running at once")
    min_batch_size: int = Field(default=4, ge=1, description="finished groups a step waits for")
    max_batch_size: int | None = Field(
        default=None, ge=1, description="most groups one step takes; None = 10 * min_batch_size"
    )
    queue_maxsize: int | None = Field(
        default=None, ge=1, description="most finished groups waiting for a step; None = no limit"
    )
    score_reference_groups_per_step: float | None = Field(
        default=8.0,
        gt=0,
        description="ART: the batch size its 'objective/score' metric compares against. artnb does not "
        "compute that metric, so setting it is reported as ignored",
    )
    score_reference_rollouts_per_group: float | None = Field(
        default=None, gt=0, description="ART: as score_reference_groups_per_step, per group"
    )

    @model_validator(mode="after")
    def _batch_bounds(self) -> PipelineRuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError(
                f"max_batch_size ({self.max_batch_size}) must be >= min_batch_size ({self.min_batch_size})"
            )
        return self

    @property
    def batch_limit(self) -> int:
        """The most groups one step takes."""
        return self.max_batch_size if self.max_batch_size is not None else 10 * self.min_batch_size


class PipelineAutotuneConfig(BaseModel):
    """ART's online tuner of the pipeline settings. artnb has none: `mode` other than "off" is reported as
    ignored. ART's tuning fields (window_steps, target_spill_probability, ...) are accepted as given."""

    model_config = ConfigDict(extra="allow")

    mode: Literal["off", "online", "profile"] = "off"
    profile: str | None = None
    output_name: str = "latest"


def resolve_pipeline(
    pipeline: PipelineRuntimeConfig | None,
    autotune: PipelineAutotuneConfig | None,
    keywords: dict[str, Any],
    score_references: dict[str, float | None],
) -> PipelineRuntimeConfig:
    """The pipeline settings from `pipeline` or the older `keywords` (PIPELINE_KEYWORDS; None = not given), and
    ART's `score_reference_*` keywords; ValueError when one setting is given twice, naming the fix."""
    given = {name: value for name, value in keywords.items() if value is not None}
    if pipeline is not None and given:
        raise ValueError(
            f"PipelineTrainer: {', '.join(sorted(given))} given both as keyword(s) and through "
            "pipeline=PipelineRuntimeConfig(...); pass them once, inside PipelineRuntimeConfig(...)"
        )
    resolved = pipeline if pipeline is not None else PipelineRuntimeConfig(**given)
    scores = {name: value for name, value in score_references.items() if value is not None}
    if twice := sorted(set(scores) & resolved.model_fields_set):
        raise ValueError(
            f"PipelineTrainer: {', '.join(twice)} given both as keyword(s) and in PipelineRuntimeConfig(...); "
            "pass them once"
        )
    resolved = PipelineRuntimeConfig.model_validate({**resolved.model_dump(exclude_unset=True), **scores})
    if {"score_reference_groups_per_step", "score_reference_rollouts_per_group"} & resolved.model_fields_set:
        report_ignored(
            "PipelineTrainer(score_reference_*=...)",
            "they scale ART's 'objective/score' metric, which artnb does not compute",
        )
    if autotune is not None and autotune.mode != "off":
        report_ignored(
            "PipelineTrainer(autotune=PipelineAutotuneConfig(mode=...))",
            "there is no pipeline autotuner here; the pipeline runs with its PipelineRuntimeConfig settings",
        )
    return resolved
