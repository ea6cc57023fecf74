"""What one GRPO step sees, shown in a notebook: each trajectory's advantage in its group, and which tokens train.

Tutorials teach the algorithm on the reader's own rollouts, so these read the same code the trainer runs
(`core.grpo.group_advantages`, `core.tokenize.tokenize_trajectory`) rather than restating it:

    art.explain.advantages(groups[0])                        # reward, advantage, trained? per trajectory
    art.explain.trained_tokens(model, groups[0].trajectories[0])     # as the trainer tokenises it
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import pandas as pd

from .core.grpo import group_advantages
from .core.tokenize import tokenize_trajectory
from .core.trajectory import Trajectory, TrajectoryGroup


def advantages(group: TrajectoryGroup, scale_rewards: bool = True) -> pd.DataFrame:
    """One row per trajectory: its reward, the group mean, its advantage, and whether it trains (advantage ≠ 0).

    The advantage is (reward - group mean), divided by the group's standard deviation when `scale_rewards`
    (TrainConfig's default), so only differences *within* the group teach anything: a group of equal rewards
    has nothing to say and is skipped.
    """
    rewards = [float(r) for r in group.rewards()]
    if not rewards:
        raise ValueError("the group has no trajectories (all its rollouts failed? see group.exceptions)")
    values = group_advantages(rewards, scale_rewards=scale_rewards)
    mean = sum(rewards) / len(rewards)
    return pd.DataFrame(
        {
            "reward": rewards,
            "group_mean": mean,
            "advantage": values,
            "trains": [a != 0 for a in values],
        }
    ).rename_axis("trajectory")


class TrainedTokens:
    """A trajectory's tokens as the trainer sees them: `table` (a DataFrame) and an HTML view in notebooks.

    Trained tokens (the ones the model sampled in a trainable turn) are highlighted, coloured by the sampling
    probability; the prompt, the tool results and the chat template's own tokens are context only.
    """

    def __init__(self, table: pd.DataFrame) -> None:
        self.table = table

    def summary(self) -> str:
        trained = int(self.table["trained"].sum())
        return f"{len(self.table)} tokens, {trained} trained ({trained / max(len(self.table), 1):.0%})"

    def _repr_html_(self) -> str:
        spans = []
        table = self.table
        for token, trained, logprob in zip(table["text"], table["trained"], table["logprob"], strict=True):
            text = html.escape(token).replace("\n", "↵<br>")
            if trained:
                p = math.exp(logprob) if math.isfinite(logprob) else 1.0
                shade = f"rgba(255,165,0,{0.25 + 0.75 * (1 - p):.2f})"  # less sure: stronger orange
                title = f"trained; p={p:.3f}" if math.isfinite(logprob) else "trained"
                spans.append(f"<span title='{title}' style='background:{shade}'>{text}</span>")
            else:
                spans.append(f"<span style='color:#888'>{text}</span>")
        return (
            f"<div class='artnb-trained-tokens'><b>{self.summary()}</b> (highlighted: trained; darker: the "
            "model was less sure)<pre style='white-space:pre-wrap'>" + "".join(spans) + "</pre></div>"
        )

    def __repr__(self) -> str:
        return f"TrainedTokens({self.summary()})"


def trained_tokens(
    tokenizer: Any,
    trajectory: Trajectory,
    history: int = 0,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TrainedTokens:
    """The tokens of one trajectory (or of its `history`-th history) with the trained ones marked.

    `tokenizer`: a model registered on a LocalBackend, whose trainer's tokenizer and chat template variables
    (`_internal_config["chat_template_kwargs"]`) are used, so the rendering is the trainer's; or any HF tokenizer
    of the base model (`backend.tokenizer_of(model)` has the model's chat template), with `template_kwargs` the
    template's variables (they override the model's). The whole trajectory is shown: a step cuts one longer
    than `max_seq_length` to its first tokens.
    """
    tokenizer, template_kwargs = _renderer(tokenizer, template_kwargs)
    sequences = tokenize_trajectory(tokenizer, trajectory, advantage=1.0, template_kwargs=template_kwargs)
    if not 0 <= history < len(sequences):
        raise IndexError(f"history={history}: this trajectory has {len(sequences)} (0 is its main messages)")
    seq = sequences[history]
    return TrainedTokens(
        pd.DataFrame(
            {
                "token_id": seq.token_ids,
                "text": [tokenizer.decode([t]) for t in seq.token_ids],
                "trained": seq.assistant_mask,
                "logprob": seq.logprobs,
            }
        )
    )


def _renderer(source: Any, template_kwargs: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and template variables the trainer renders with: a registered model's own (its backend's
    slot), or the tokenizer given with `template_kwargs`."""
    from .core.model import TrainableModel

    if not isinstance(source, TrainableModel):
        return source, dict(template_kwargs or {})
    served_model = getattr(source.backend(), "served_model", None)
    if served_model is None:
        raise TypeError(
            f"model {source.name!r} is registered on a {type(source.backend()).__name__}, which keeps no "
            "tokenizer here: pass a tokenizer of its base model (and template_kwargs) instead"
        )
    served = served_model(source, required=True)
    return served.tokenizer, {**served.settings.chat_template_kwargs, **(template_kwargs or {})}
