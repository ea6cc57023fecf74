"""`_internal_config`'s chat template and its variables, end to end on a LocalBackend with the HF engine: the
engine renders every client's prompt with them (a request's own `chat_template_kwargs` still win), and the
trainer tokenises the same rendering, so what is trained is what was sampled."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

import artnb as art
from artnb.backends.engine_launch import chat_template_options
from artnb.core.sft import tokenize_sft
from artnb.core.tokenize import tokenize_groups
from artnb.dev.settings import resolve_internal_config
from artnb.models import tiny

MESSAGES = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
# written before the tiny tokenizer's own template when the template variable `greeting` is set
GREETING = "{% if greeting is defined %}{{ greeting }}{% endif %}"


@pytest.fixture(scope="module")
def base() -> str:
    return tiny(hidden_size=64, num_layers=2, seed=1)


async def ask(client: openai.AsyncOpenAI, model: art.TrainableModel, seed: int, **extra):
    return await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        seed=seed,
        extra_body={"guided_choice": ["A", "B"], **extra},
    )


def prompt_ids(completion) -> list[int]:
    """The token ids the engine rendered the prompt into (artnb's engines and vLLM return them)."""
    return (completion.model_extra or {})["prompt_token_ids"]


def prompt_text(completion, tokenizer) -> str:
    return tokenizer.decode(prompt_ids(completion))


async def test_the_engine_and_the_trainer_render_with_the_configured_template_and_kwargs(tmp_path, base):
    template = GREETING + AutoTokenizer.from_pretrained(base).chat_template
    model = art.TrainableModel(
        name="agent",
        project="p",
        base_model=base,
        _internal_config={"chat_template_kwargs": {"greeting": "MARK-DEFAULT"}, "chat_template": template},
    )
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        tokenizer = backend.tokenizer_of(model)
        assert tokenizer.chat_template == template
        # any client on the engine's address gets the defaults: they are the server's, not the client's
        raw = openai.AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
        plain = await ask(raw, model, seed=1)
        assert prompt_text(plain, tokenizer).startswith("MARK-DEFAULT<|im_start|>system")
        own = await ask(raw, model, seed=1, chat_template_kwargs={"greeting": "MARK-OWN"})
        assert prompt_text(own, tokenizer).startswith("MARK-OWN<|im_start|>")  # the request's own win
        await raw.close()

        client = model.openai_client()
        completions = [await ask(client, model, seed=s) for s in range(4)]
        trajectories = [
            art.Trajectory(messages_and_choices=[*MESSAGES, c.choices[0]], reward=float(i % 2))
            for i, c in enumerate(completions)
        ]
        groups = [art.TrajectoryGroup(trajectories[:2]), art.TrajectoryGroup(trajectories[2:])]
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert result.step == 1

        # the step trained sequences rendered with the marker: as many tokens as that rendering has
        marked = tokenize_groups(tokenizer, groups, template_kwargs={"greeting": "MARK-DEFAULT"})
        unmarked = tokenize_groups(tokenizer, groups)
        assert result.metrics["data/num_tokens"] == marked.metrics["num_tokens"]
        assert marked.metrics["num_tokens"] > unmarked.metrics["num_tokens"]
        # and what the trainer sees starts with exactly the prompt the engine sampled from
        view = art.explain.trained_tokens(model, trajectories[0])
        prompt = prompt_ids(completions[0])
        assert list(view.table["token_id"][: len(prompt)]) == prompt
        assert not view.table["trained"][: len(prompt)].any() and view.table["trained"][len(prompt)]

        # an SFT step renders the same way
        sft = await model.train_sft(trajectories, config=art.TrainSFTConfig(learning_rate=1e-3, batch_size=4))
        config = art.TrainSFTConfig(batch_size=4)
        marked = tokenize_sft(tokenizer, trajectories, config, template_kwargs={"greeting": "MARK-DEFAULT"})
        assert sft.metrics["data/num_tokens"] == marked.metrics["num_tokens"]
        assert (
            marked.metrics["num_tokens"] > tokenize_sft(tokenizer, trajectories, config).metrics["num_tokens"]
        )


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"chat_template": "{{ x }}"}, "chat_template"),
        ({"default_chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"extra_args": ["--chat-template=t.jinja"]}, "chat_template"),
        ({"extra_args": ["--default-chat-template-kwargs", "{}"]}, "chat_template_kwargs"),
    ],
)
def test_engine_options_cannot_give_the_engine_a_template_the_trainer_would_not_use(options, key):
    settings = resolve_internal_config({"chat_template_kwargs": {"x": 2}}, on_cuda=False)
    with pytest.raises(ValueError, match=rf"pass it as the model's _internal_config\['{key}'\] instead"):
        chat_template_options(options, settings)
    assert chat_template_options({"extra_args": ["--seed", "1"]}, settings) == {
        "chat_template": None,
        "default_chat_template_kwargs": {"x": 2},
    }
