"""Every metric name artnb writes, with its meaning: the one place history rows, curves, widgets, the report and
the integrations (W&B, Langfuse) take metric names from.

A name is `{section}/{metric}`. The sections:
- a split ("train", "val", or any split a user logs): the rollout summary of that split's groups (ROLLOUT), plus
  each trajectory metric and group metric (`group_<name>`) the user's rollouts report, averaged;
- "train" also holds what the trainer measured on the step (TRAINER);
- "data": the batch as the trainer saw it (DATA), only what the rollout summary and trainer do not already say;
- "time": durations (TIME);
- "throughput": how long the trainer and the rollouts waited for each other (THROUGHPUT);
- "costs": spend on judges and hosted models (`costs/{source}/{kind}`, COSTS), cumulative over the step.
Each value is written once per step: `drop_duplicates` removes a `data/` value that `train/` already holds.
A spread is `{metric}{STD_SUFFIX}` next to its metric (what the reward plot draws as a band).
W&B also gets a table per split and batch (TABLES, never in the history) and plots everything against STEP_AXIS.
"""

from __future__ import annotations

import re
from typing import Any

STD_SUFFIX = "_std_dev"
SPLITS = ("train", "val", "test")  # artnb's own; users may log others

ROLLOUT = {
    "reward": "mean reward over the split's trajectories",
    "reward" + STD_SUFFIX: "mean over groups of the reward's std within the group (what GRPO divides by)",
    "exception_rate": "failed rollouts / all rollouts",
    "num_trajectories": "trajectories in the split's groups",
}
TRAINER = {
    "loss": "the step's GRPO (or SFT batch) loss",
    "policy_loss": "the policy-gradient part of the loss",
    "kl": "mean k3 KL to the reference policy (only with kl_penalty_coef > 0)",
    "grad_norm": "gradient norm before clipping",
    "clip_fraction": "share of trainable tokens whose importance ratio was clipped",
    "ratio_mean": "mean importance ratio new/sampling policy",
    "ratio_std": "spread (std over trainable tokens) of that ratio, before clipping: grows with off-policy lag",
    "steps_off_policy": "mean over the batch's rollouts of (trained step - step of the policy that sampled it)",
    "steps_off_policy_max": "the largest such lag in the batch",
    "discarded_stale_groups": "groups PipelineTrainer dropped before this step for being too far off-policy",
    "logprob_mismatch": "mean |trainer logprob - engine logprob| on sampled tokens",
    "learning_rate": "the learning rate used",
    "num_trainable_tokens": "tokens the loss was computed on",
    "num_sequences": "sequences trained on",
    "num_micro_batches": "forward/backward passes",
    "tokens_per_second": "trainer throughput (all tokens)",
    "seconds": "trainer time (forward, backward, optimizer)",
    "sft_loss": "SFT loss per trainable token over the call's batches",
    "sft_loss_last_batch": "SFT loss of the last batch",
    "num_gradient_steps": "optimizer steps in an SFT call",
    "skipped": "1 when the step made no update (equal rewards, or on_nothing_to_train='skip')",
    "after_each_failures": "groups whose after_each scorer failed in the gather",
}
DATA = {
    "num_groups": "groups in the batch",
    "num_groups_trainable": "groups with a reward spread (the others teach nothing)",
    "num_zero_advantage_skipped": "trajectories with zero advantage, left out",
    "num_groups_too_small": "groups left with fewer than 2 finished rollouts (the others failed), left out",
    "num_dropped_too_long": "sequences left out for their length (RL: no sampled token within max_seq_length)",
    "num_truncated_too_long": "sequences over max_seq_length, trained on their first max_seq_length tokens",
    "num_histories_without_turns": "histories with no assistant message (an agent that never played), left out",
    "num_tokens": "tokens in the trained sequences, prompts included",
    "num_trajectories": "trajectories given to an SFT step",
    "num_sequences": "sequences built from the batch (when no trainer ran)",
    "num_trainable_tokens": "trainable tokens in the batch (when no trainer ran)",
    "reward": "mean reward the batch was tokenised with (when no rollout summary exists)",
    "reward" + STD_SUFFIX: "within-group reward std of the batch (when no rollout summary exists)",
    "step_num_scenarios": "scenarios rolled out for the step (metrics builder's add_data)",
    "step_actor_tokens": "tokens the rollouts sampled for the step (add_data)",
    "num_unique_scenarios": "distinct scenario ids seen so far in this kernel (add_data's scenario_ids)",
}
TIME = {
    "step_train_s": "wall seconds of the train call: validate to commit",
    "step_wall_s": "wall seconds of the whole step (a loop's own timing, or PipelineTrainer's)",
    "step_actor_s": "seconds spent rolling out the step's groups",
    "step_eval_s": "seconds spent evaluating",
}
THROUGHPUT = {
    "step_trainer_idle_s": "seconds the trainer waited for rollouts before this step",
    "step_actor_idle_s": "seconds rollouts waited (paused by the off-policy bound) during this step",
}
TABLES = {"trajectories": "W&B only: up to 32 sampled trajectories of the batch (messages, reward, metrics)"}
COSTS = {
    "usd": "estimated spend in US dollars (litellm's price table; absent when the model's price is unknown)",
    "prompt_tokens": "prompt tokens sent",
    "completion_tokens": "completion tokens received",
    "requests": "requests made",
}

# The names other modules read and write by name.
STEP_TRAIN_S = "time/step_train_s"
SKIPPED = "train/skipped"
SFT_LOSS = "train/sft_loss"
LOSS = "train/loss"
AFTER_EACH_FAILURES = "train/after_each_failures"
BEST_CHECKPOINT_METRIC = "val/reward"  # delete_checkpoints' default, as ART's
TRAJECTORIES_TABLE = "trajectories"  # W&B: `{split}/trajectories`
STEP_AXIS = "training_step"  # W&B's x-axis for every metric: the step of the policy that produced the data

_COST_NAME = re.compile(r"^costs/[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*/(" + "|".join(COSTS) + ")$")


def split_metric(split: str, metric: str) -> str:
    """`{split}/{metric}`, e.g. ("val", "reward") -> "val/reward"."""
    return f"{split}/{metric}"


def std_of(metric: str) -> str:
    """The name of a metric's spread: "reward" -> "reward_std_dev"."""
    return metric + STD_SUFFIX


def data(metric: str) -> str:
    if metric not in DATA:
        raise KeyError(f"data/{metric} is not in artnb/core/metric_names.py's DATA")
    return f"data/{metric}"


def time(metric: str) -> str:
    if metric not in TIME:
        raise KeyError(f"time/{metric} is not in artnb/core/metric_names.py's TIME")
    return f"time/{metric}"


def throughput(metric: str) -> str:
    if metric not in THROUGHPUT:
        raise KeyError(f"throughput/{metric} is not in artnb/core/metric_names.py's THROUGHPUT")
    return f"throughput/{metric}"


def trainer(metric: str) -> str:
    if metric not in TRAINER:
        raise KeyError(f"train/{metric} is not in artnb/core/metric_names.py's TRAINER")
    return f"train/{metric}"


def cost(source: str, kind: str) -> str:
    """`costs/{source}/{kind}`, e.g. ("judge/ruler", "usd") -> "costs/judge/ruler/usd"."""
    name = f"costs/{source.strip('/')}/{kind}"
    if not _COST_NAME.match(name):
        raise ValueError(f"{name!r}: a cost is costs/<source>/<{'|'.join(COSTS)}>, source of [A-Za-z0-9_.-/]")
    return name


def describe(name: str) -> str | None:
    """What an artnb metric means; None for a name artnb does not define (e.g. a user's own metric)."""
    section, _, metric = name.partition("/")
    if section == "data":
        return DATA.get(metric)
    if section == "time":
        return TIME.get(metric)
    if section == "throughput":
        return THROUGHPUT.get(metric)
    if section == "costs":
        return COSTS[name.rsplit("/", 1)[1]] if _COST_NAME.match(name) else None
    if section == "train" and metric in TRAINER:
        return TRAINER[metric]
    return (ROLLOUT.get(metric) or TABLES.get(metric)) if section and metric else None


def drop_duplicates(row: dict[str, Any]) -> dict[str, Any]:
    """`row` without the `data/` values that `train/` already holds (each value is written once)."""
    return {k: v for k, v in row.items() if not (k.startswith("data/") and "train/" + k[5:] in row)}
