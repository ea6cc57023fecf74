"""One training step of LocalBackend as a transaction, written top to bottom as its phases.

    validate → tokenise → hold → train → commit (→ rename) → publish → hot-load → release

A step is a GRPO step (`train_step`: groups, one optimizer step) or an SFT step (`train_sft_step`: trajectories,
one optimizer step per batch); what differs (checks, "tokenise", "train", the history row) is the step's kind
(step_kinds.py). An SFT step records its trajectories as the step's rollouts and `train/sft_loss` in its history
row. AdamW's moments are reset when the kind of step changes (as ART does): SFT gradients are larger and steadier
than GRPO's, and their second moments would shrink the first RL updates for ~100 steps.

Until the commit nothing on disk changes. The commit (`RunStore.commit_step`) writes checkpoint step+1 with the
step's history row and rollouts inside it and renames it into place: after that rename the step happened, and
what follows (the directory's fsync, publishing the row and rollouts, loading the adapter into the engine,
releasing held requests) cannot undo it; a failure there is a warning, and the work is finished later
(`RunStore.publish_pending`, the engine transport). A failure before the commit reloads the trainer from the last
checkpoint, so the weights and optimizer in memory are never ahead of the disk.

Between the commit and publish the trainer gives its cached GPU memory back (`free_memory`), so that the engine,
asleep on the same GPU while it is held, can wake to load the new adapter; it does so after a failed train too.

Cancellation (a cell interrupt, `asyncio.wait_for`): the step runs in a task of its own. Cancelled before the
trainer starts, the step stops there; after, the caller waits for the commit and then sees the cancellation, as
`CommittedWhileCancelled` (local.py) carrying what the step produced, which the model records and says.

Each phase is logged at DEBUG on the "artnb" logger with `record.artnb_phase` (the reliability tests kill a
training process at each one). Warnings are collected and shown in the caller's frame when `run` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NoReturn, TypeVar

from ..core import metric_names as names
from ..core.atomic import disk_full
from ..core.config import TrainConfig
from ..core.ignored import warn_user
from ..core.model import NothingToTrainError, TrainResult
from ..core.sft import SFTBatches, TrainSFTConfig
from ..core.store import RunStore
from ..core.tokenize import TokenizedBatch
from ..core.trajectory import TrajectoryGroup
from ..dev.settings import InternalSettings
from .machine_bill import COST_KEY
from .served import ServedModel
from .step_kinds import step_kind

log = logging.getLogger("artnb")


class DiskFullError(OSError):
    """The run directory's disk (or quota) filled up before a step could commit; nothing of the step was written."""


PHASES = ("validate", "tokenise", "hold", "train", "commit", "rename", "publish", "hot-load", "release")


class TrainStep:
    """One `backend.train_step(model, request)` or `train_sft_step` call: its phases, and
    whether it can still be abandoned. An SFT step gets its trajectories as one group."""

    def __init__(
        self,
        served: ServedModel,
        groups: list[TrajectoryGroup],
        config: TrainConfig | TrainSFTConfig,
        extra_row: dict[str, Any] | None = None,
    ) -> None:
        self.served, self.groups, self.config = served, groups, config
        self.kind = step_kind(config)
        self.extra_row = dict(extra_row or {})  # more values for the step's history row
        self.step = served.step
        self.phase = "queued"
        self.irreversible = False  # past "train": the step commits even if the caller is cancelled
        self.notes: list[str] = []
        self.started = 0.0
        self.finished: TrainResult | None = None  # what the step produced though its caller was cancelled

    async def run(self) -> TrainResult:
        """Run the step in its own task; see the module docstring for what cancelling the caller does."""
        task = asyncio.ensure_future(self._phases())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not self.irreversible:
                task.cancel()  # nothing trained yet: stop here, releasing the engine if it was held
                await asyncio.wait([task])
                raise
            await _wait_through_cancellation(task)  # the trainer is running: let the step commit first
            if not task.cancelled() and task.exception() is None:
                self.finished = task.result()
            raise
        finally:
            for note in self.notes:
                warn_user(note)

    async def _phases(self) -> TrainResult:
        served = self.served
        async with served.step_lock:  # one step at a time per model
            self.started = time.monotonic()
            self.step = served.step
            await asyncio.to_thread(served.store.publish_pending)  # what an earlier step could not publish
            self._enter("validate")
            if reason := self.kind.empty_reason(self.groups):
                return await self._nothing_to_train(reason)
            batch = await self._tokenise()
            metrics: dict[str, Any] = {names.data(k): v for k, v in batch.metrics.items()}
            if not batch.sequences:
                reason = batch.skipped_reason
                assert reason is not None, "a tokeniser that leaves no sequence says why"
                if self.kind.nothing_left(batch):
                    return await self._nothing_to_train(reason)
                return await self._advance_without_update(metrics, reason)
            try:
                await self._hold()
                try:
                    metrics.update(await self._train(batch))
                    result = await self._commit(metrics, served.trainer.save_checkpoint)
                except BaseException:
                    await self._restore_trainer()
                    raise
                finally:
                    await self._free_trainer_memory()
                await self._publish_and_hot_load()
            finally:
                await self._release()
            return result

    # phases ---------------------------------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.irreversible = self.irreversible or phase == "train"
        store = self.served.store
        log.debug(
            "%s/%s step %d: %s", store.project, store.name, self.step, phase, extra={"artnb_phase": phase}
        )

    async def _tokenise(self) -> TokenizedBatch | SFTBatches:
        """GRPO: advantages and the sampled turns of every group. SFT: batches of the assistant turns."""
        self._enter("tokenise")
        config, served = self.config, self.served
        max_seq_length = config.max_seq_length or served.trainer.max_seq_length
        return await self.kind.tokenise(
            served.tokenizer,
            self.groups,
            config,
            max_seq_length,
            template_kwargs=served.settings.chat_template_kwargs,
        )

    async def _nothing_to_train(self, reason: str) -> TrainResult:
        """No data to learn from: an error, or (if asked) a skipped step in the history without a checkpoint."""
        store, step = self.served.store, self.step
        if self.kind.raises_when_nothing(self.config):
            raise NothingToTrainError(
                f"nothing to train on at step {step}: {reason}. The step did not advance and nothing was "
                f"written. {self.kind.advice}"
            )
        metrics = {names.SKIPPED: 1}
        await asyncio.to_thread(store.append_history, self._history_row(metrics))
        return TrainResult(
            step=step, metrics=metrics, checkpoint_path=str(store.checkpoint_path(step)), skipped=reason
        )

    async def _advance_without_update(self, metrics: dict[str, Any], reason: str) -> TrainResult:
        """Equal rewards in every group: a real, measured step with no gradient. It commits a copy of the
        checkpoint with the rollouts, so step-driven loops (and datasets resumed by step) move on, as in ART."""
        self.notes.append(
            f"artnb: step {self.step} had nothing to train on: {reason}. The step still advances (checkpoint "
            f"{self.step + 1:04d} = {self.step:04d}) and its rollouts are recorded."
        )
        metrics[names.SKIPPED] = 1
        result = await self._commit(metrics, None)
        await self._publish_and_hot_load()
        return result.model_copy(update={"skipped": reason})

    async def _hold(self) -> None:
        self._enter("hold")
        await self.served.ensure_engine()
        await self.served.engine.hold()

    async def _train(self, batch: TokenizedBatch | SFTBatches) -> dict[str, Any]:
        """The update: one GRPO optimizer step, or one SFT optimizer step per batch at its learning rate."""
        self._enter("train")
        trainer, on_trainer_thread = self.served.trainer, self.served.on_trainer_thread
        if _last_update_kind(self.served.store, self.step) not in (None, self.kind.name):
            await on_trainer_thread(trainer.reset_optimizer)
        return await self.kind.train(on_trainer_thread, trainer, batch, self.config)

    async def _commit(self, metrics: dict[str, Any], write: Any) -> TrainResult:
        """Checkpoint step+1 (written by `write`, or a copy when None) with the history row and the rollouts in
        it, in one rename: the commit point."""
        served, step = self.served, self.step
        self._enter("commit")
        metrics[names.STEP_TRAIN_S] = time.monotonic() - self.started
        if served.bill is not None:
            metrics[COST_KEY] = served.bill.take()
        row = self._history_row(metrics)
        try:
            await served.on_trainer_thread(served.store.commit_step, step, write, row, self.groups)
        except Exception as error:
            # FileExistsError: checkpoint step+1 was there already (not this step's); no record: before the rename
            if isinstance(error, FileExistsError) or served.store.read_commit(step + 1) is None:
                self._uncommitted(error, metrics)
            # else it raised after its own rename (the directory's fsync): the step happened, as the disk shows
            self.notes.append(
                f"artnb: step {step} is committed (checkpoint {step + 1:04d} is in place), but the disk reported an "
                f"error after writing it ({error}). The run goes on at step {step + 1}; check that disk, since a "
                "power loss now could lose the newest checkpoint"
            )
        served.step = step + 1
        return TrainResult(
            step=step + 1, metrics=metrics, checkpoint_path=str(served.store.checkpoint_path(step + 1))
        )

    def _uncommitted(self, error: Exception, metrics: dict[str, Any]) -> NoReturn:
        """The commit failed before its rename: nothing of the step is on disk. Give its bill back and raise."""
        served, step = self.served, self.step
        if served.bill is not None:
            served.bill.give_back(metrics.pop(COST_KEY))
        if disk_full(error, served.store.dir):
            raise DiskFullError(
                f"the disk of the run directory {served.store.dir} is full ({error}): step {step} was not "
                f"committed, and the run stays at step {step} with every committed step intact. Free some "
                "space there (e.g. `await model.delete_checkpoints()`), then call train again with the same "
                "groups"
            ) from error
        raise error

    async def _free_trainer_memory(self) -> None:
        """The trainer's cached GPU memory back to the device, before the engine wakes (part of commit)."""
        await self.served.on_trainer_thread(self.served.trainer.free_memory)

    async def _publish_and_hot_load(self) -> None:
        """After the commit: failures here are warnings, and the work is redone later (never undone)."""
        served = self.served
        self._enter("publish")
        try:
            await asyncio.to_thread(served.store.publish, served.step)
        except Exception as error:
            full = " (the disk is full: free some space there)" if disk_full(error, served.store.dir) else ""
            self.notes.append(
                f"artnb: step {self.step} is committed, but writing its history row and rollouts failed "
                f"({error}){full}; they are kept in checkpoint {served.step:04d} and written at the next step "
                "or register"
            )
        self._enter("hot-load")
        try:
            await served.ensure_engine()
        except Exception as error:
            self.notes.append(
                f"artnb: step {served.step} is committed, but the engine could not load it ({error}); the "
                "next request loads it"
            )

    async def _restore_trainer(self) -> None:
        """Put the trainer back to the last committed checkpoint after the step failed before its commit."""
        served = self.served
        await served.on_trainer_thread(
            served.trainer.load_checkpoint, served.store.checkpoint_path(served.step)
        )

    async def _release(self) -> None:
        served = self.served
        self._enter("release")
        if not served.engine.alive():
            return  # a dead engine holds nothing; the next request restarts it
        try:
            await served.engine.release()
        except Exception as error:
            self.notes.append(
                f"artnb: could not release the inference engine after step {self.step} ({error}); it is "
                "stopped so that no request waits forever, and the next request restarts it"
            )
            await served.engine.stop()

    def _history_row(self, metrics: dict[str, Any]) -> dict[str, Any]:
        summary = self.kind.row_summary(self.groups, self.step)
        return names.drop_duplicates(
            {"step": self.step, "split": "train", **summary, **self.extra_row, **metrics}
        )


def _last_update_kind(store: RunStore, step: int) -> str | None:
    """What made the newest update in checkpoint `step`: "sft", "rl", or None (a fresh adapter). Read from the
    commit records, so it survives restarts; steps without an update (copied checkpoints) are looked through."""
    for checkpoint in range(step, 0, -1):
        commit = store.read_commit(checkpoint)
        if commit is None:
            return None
        if names.SFT_LOSS in commit.history:
            return "sft"
        if names.SKIPPED not in commit.history:
            return "rl"
    return None


_StepConfig = TypeVar("_StepConfig", TrainConfig, TrainSFTConfig)


def with_max_seq_length(config: _StepConfig, settings: InternalSettings) -> _StepConfig:
    """A step's config with the model's max_seq_length (its `_internal_config`) when the step set none."""
    if config.max_seq_length is None and settings.max_seq_length:
        return config.model_copy(update={"max_seq_length": settings.max_seq_length})
    return config


async def _wait_through_cancellation(task: asyncio.Future) -> None:
    """Wait until `task` is done, even if this coroutine is cancelled again meanwhile."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue
