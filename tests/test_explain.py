"""art.explain: what a tutorial shows of one GRPO step, read from the same code the trainer runs."""

import pytest
from tiny_loop import gather

import artnb as art
from artnb import models


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny()


def test_advantages_are_differences_within_the_group():
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=r)
            for r in (1, 0, 0, 1)
        ]
    )
    table = art.explain.advantages(group)
    assert list(table["reward"]) == [1, 0, 0, 1] and set(table["group_mean"]) == {0.5}
    assert list(table["advantage"]) == pytest.approx([1, -1, -1, 1], rel=1e-5) and table["trains"].all()
    assert list(art.explain.advantages(group, scale_rewards=False)["advantage"]) == [0.5, -0.5, -0.5, 0.5]
    equal = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=0.3)
            for _ in range(3)
        ]
    )
    assert not art.explain.advantages(equal)["trains"].any()


async def test_trained_tokens_are_exactly_what_the_model_sampled(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, seed=0)
        trajectory = groups[0].trajectories[0]
        tokenizer = backend.tokenizer_of(model)
        view = art.explain.trained_tokens(tokenizer, trajectory)
    choice = trajectory.messages_and_choices[-1]
    trained = view.table[view.table["trained"]]
    assert list(trained["token_id"]) == list(choice.token_ids)  # the sampled ids, never re-tokenised
    assert trained["logprob"].tolist() == pytest.approx([lp.logprob for lp in choice.logprobs.content])
    assert not view.table.loc[: trained.index[0] - 1, "trained"].any()  # the prompt is context only
    html = view._repr_html_()
    assert "artnb-trained-tokens" in html and f"{len(trained)} trained" in html
    with pytest.raises(IndexError, match="history=1"):
        art.explain.trained_tokens(tokenizer, trajectory, history=1)
