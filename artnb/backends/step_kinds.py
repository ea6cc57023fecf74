"""What differs between a GRPO step and an SFT step, one object per kind, so that TrainStep reads the same for both.

Why: the transaction (validate, tokenise, hold, train, commit, publish, hot-load, release; train_step.py) is the
same for both kinds; only the batch's checks, its tokenisation, the update, what an empty batch means and what
the history row summarises differ. Each kind says those in one place instead of a branch in every phase.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Protocol

from tqdm.auto import tqdm

from ..core import metric_names as names
from ..core.config import TrainConfig
from ..core.contracts import Trainer
from ..core.model import summarize_groups
from ..core.sft import SFTBatches, TrainSFTConfig, summarize_sft_updates, tokenize_sft
from ..core.tokenize import TokenizedBatch, tokenize_groups
from ..core.trajectory import TrajectoryGroup

OnTrainerThread = Callable[..., Awaitable[Any]]  # runs a trainer call on the backend's trainer thread


def _empty_batch_reason(groups: list[TrajectoryGroup]) -> str | None:
    if not groups:
        return "the batch is empty (no groups: were they all dropped by after_each / RULER?)"
    if not any(g.trajectories for g in groups):
        return "no group of the batch has a trajectory (did every rollout fail?)"
    return None


class GRPOStep:
    """One GRPO step: groups scored by reward, one optimizer step over all their sampled turns."""

    name = "rl"  # what the commit records say made the update (train_step._last_update_kind)

    def empty_reason(self, groups: list[TrajectoryGroup]) -> str | None:
        return _empty_batch_reason(groups)

    async def tokenise(
        self,
        tokenizer: Any,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        max_seq_length: int,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenizedBatch:
        return await asyncio.to_thread(
            tokenize_groups,
            tokenizer,
            groups,
            scale_rewards=config.scale_rewards,
            allow_training_without_logprobs=config.allow_training_without_logprobs,
            max_seq_length=max_seq_length,
            template_kwargs=template_kwargs,
        )

    def nothing_left(self, batch: TokenizedBatch) -> bool:
        """No sequence left because they were too long, or because every group lost its rollouts but one to
        failures: nothing to train. (Equal rewards everywhere is a real measurement instead: the step advances
        without an update.)"""
        m = batch.metrics
        every_group_too_small = m["num_groups_too_small"] == m["num_groups"]
        return not batch.sequences and (bool(m["num_dropped_too_long"]) or every_group_too_small)

    def raises_when_nothing(self, config: TrainConfig) -> bool:
        return config.on_nothing_to_train == "raise"

    advice = "Gather again, or pass on_nothing_to_train='skip' to record a skipped step instead"

    async def train(
        self, on_trainer_thread: OnTrainerThread, trainer: Trainer, batch: TokenizedBatch, config: TrainConfig
    ) -> dict[str, Any]:
        trained = await on_trainer_thread(trainer.train, batch.sequences, config)
        return {names.trainer(k): v for k, v in trained.items()}

    def row_summary(self, groups: list[TrajectoryGroup], step: int) -> dict[str, Any]:
        """The batch's rollout summary and the policy lag of its rollouts, for the step's history row."""
        summary = {names.split_metric("train", k): v for k, v in summarize_groups(groups).items()}
        return {**summary, **policy_lag(groups, step)}


class SFTStep:
    """One SFT step: the assistant turns of one group of trajectories, one optimizer step per batch."""

    name = "sft"

    def empty_reason(self, groups: list[TrajectoryGroup]) -> str | None:
        if not any(g.trajectories for g in groups):
            return "train_sft got no trajectories"
        return _empty_batch_reason(groups)

    async def tokenise(
        self,
        tokenizer: Any,
        groups: list[TrajectoryGroup],
        config: TrainSFTConfig,
        max_seq_length: int,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> SFTBatches:
        return await asyncio.to_thread(
            tokenize_sft,
            tokenizer,
            groups[0].trajectories,
            config,
            max_seq_length=max_seq_length,
            template_kwargs=template_kwargs,
        )

    def nothing_left(self, batch: SFTBatches) -> bool:
        return not batch.sequences

    def raises_when_nothing(self, config: TrainSFTConfig) -> bool:
        return True

    advice = "Check the examples: SFT trains their assistant turns"

    async def train(
        self, on_trainer_thread: OnTrainerThread, trainer: Trainer, batch: SFTBatches, config: TrainSFTConfig
    ) -> dict[str, Any]:
        updates = []
        with tqdm(total=len(batch.batches), desc="sft train") as bar:
            for sequences, learning_rate in zip(batch.batches, batch.learning_rates, strict=True):
                update = partial(
                    trainer.train_sft,
                    sequences,
                    learning_rate,
                    max_grad_norm=config.max_grad_norm,
                    weight_decay=config.weight_decay,
                    micro_batch_tokens=config.micro_batch_tokens,
                )
                updates.append(await on_trainer_thread(update))
                bar.update()
                bar.set_postfix(loss=f"{updates[-1]['loss']:.4f}")
        return {names.trainer(k): v for k, v in summarize_sft_updates(updates).items()}

    def row_summary(self, groups: list[TrajectoryGroup], step: int) -> dict[str, Any]:
        return {}  # examples have no reward: a 0 in train/reward would look like a collapse on the reward plot


class StepKind(Protocol):
    """What TrainStep asks of a kind. Each kind takes the config and batch of its own types (GRPOStep: TrainConfig
    and TokenizedBatch; SFTStep: TrainSFTConfig and SFTBatches); `step_kind` pairs the kind with its config, and
    the batch a kind's `tokenise` returns goes back to the same kind, so those are `Any` here."""

    name: str
    advice: str

    def empty_reason(self, groups: list[TrajectoryGroup]) -> str | None: ...

    async def tokenise(
        self,
        tokenizer: Any,
        groups: list[TrajectoryGroup],
        config: Any,
        max_seq_length: int,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenizedBatch | SFTBatches:
        """The batch as the trainer takes it, rendered with the chat template's variables `template_kwargs`
        (the model's `_internal_config["chat_template_kwargs"]`, the engine's defaults too)."""
        ...

    def nothing_left(self, batch: Any) -> bool: ...

    def raises_when_nothing(self, config: Any) -> bool: ...

    async def train(
        self, on_trainer_thread: OnTrainerThread, trainer: Trainer, batch: Any, config: Any
    ) -> dict[str, Any]: ...

    def row_summary(self, groups: list[TrajectoryGroup], step: int) -> dict[str, Any]: ...


def step_kind(config: TrainConfig | TrainSFTConfig) -> StepKind:
    return SFTStep() if isinstance(config, TrainSFTConfig) else GRPOStep()


def policy_lag(groups: list[TrajectoryGroup], step: int) -> dict[str, float]:
    """How many steps behind `step` the policies that sampled the batch were (from each trajectory's
    `initial_policy_version`; nothing when no trajectory has one, as in a synchronous loop's batch)."""
    lags = [
        step - t.initial_policy_version
        for g in groups
        for t in g.trajectories
        if t.initial_policy_version is not None
    ]
    if not lags:
        return {}
    return {
        names.trainer("steps_off_policy"): sum(lags) / len(lags),
        names.trainer("steps_off_policy_max"): float(max(lags)),
    }
