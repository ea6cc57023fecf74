"""Trajectory -> token ids, trainable-token mask and sampling logprobs (the trainer's only input)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenizedSequence:
    """One conversation (a trajectory's main history or one of its additional histories), ready to train."""

    token_ids: list[int]
    assistant_mask: list[bool]  # True on tokens the model sampled in a trainable turn
    logprobs: list[float]  # sampling logprob on trainable tokens (NaN where unknown), NaN elsewhere
    advantage: float  # the trajectory's group advantage, shared by all its tokens
    group_index: int
    trajectory_index: int
