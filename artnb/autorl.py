"""AutoRL: train on a task you only describe. No data set, no reward function: RULER is the only reward.

Why it exists: most tasks people want a model to learn ("reply kindly to complaints", "fix this grammar")
have no labelled data and no checkable answer. AutoRL asks a generator model for the inputs
(`generate_scenarios`), lets the policy answer each one a few times (`rollout`), and lets a RULER judge rank
the answers of each group against the task description; GRPO trains on those ranks. `evaluate` then puts the
base and the trained model's answers to held-out inputs side by side before the same judge.

Design choices:
- A scenario is one user message (`Scenario.task`) and a difficulty from 1 to 5, which asks the generator
  to spread them. The task description becomes the rollout's system prompt, so the judge sees it too.
- The generator is an `art.Model` (e.g. `model.as_base_model()`: offline, no key) called through its OpenAI
  client with a strict JSON schema, which artnb's HF and vLLM engines enforce while decoding, so even the
  135M model returns valid JSON with lengths in bounds; or a litellm model string ("openai/gpt-4o-mini"),
  whose replies are parsed and checked here (hosted providers reject most length keywords in strict schemas).
- Asked in batches (`batch_size` per request), several requests at once, each with its own seed; every
  request lists the scenarios kept so far and asks for new ones. Replies are deduplicated on normalised text
  and on token-set (Jaccard) similarity, since small models repeat themselves with one word changed.
- Generation stops at `n` or after `max_requests`; falling short raises `ScenarioGenerationError` saying how
  many requests were made and why scenarios were refused (or warns, with `allow_fewer=True`).
- Evaluation scores each held-out scenario's answers from every policy in ONE group, so the judge compares
  base and trained answers to the same input directly instead of grading each on a separate scale.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import warnings
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm.auto import tqdm

from .core import costs
from .core.gather import gather_trajectory_groups
from .core.judge_requests import RulerError
from .core.model import Model, TrainableModel
from .core.ruler import DEFAULT_RUBRIC, ruler_score_group
from .core.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    import litellm
    from openai.types.chat import ChatCompletionMessageParam
    from openai.types.shared_params import ResponseFormatJSONSchema

    from .core.contracts import InProcessJudge

MIN_TASK_CHARS = 8  # shorter is not a real request ("hi", "ok")
MAX_TASK_CHARS = 400  # keeps prompts (and the judge's context) short; raise it for long-input tasks
DEFAULT_SIMILARITY = 0.8  # token-set Jaccard above which two scenarios count as the same one
_AVOID_SHOWN = 40  # how many kept scenarios a request lists as "already written"


class Scenario(BaseModel):
    """One input for the task: the user's message and how hard it is (1 easy to 5 hard)."""

    model_config = ConfigDict(extra="forbid")
    task: str = Field(
        min_length=MIN_TASK_CHARS,
        max_length=MAX_TASK_CHARS,
        description="the user's message the assistant must answer",
    )
    difficulty: int = Field(ge=1, le=5, description="1 (easy) to 5 (hard)")

    @field_validator("task", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value


class ScenarioGenerationError(RuntimeError):
    """Fewer scenarios than asked for after the allowed requests; the message says why."""


class GeneratedScenarios(list[Scenario]):
    """The scenarios, plus how they were obtained: requests made and what was refused, by reason."""

    def __init__(self, scenarios: Iterable[Scenario] = (), **stats: int) -> None:
        super().__init__(scenarios)
        self.requests = stats.get("requests", 0)
        self.proposed = stats.get("proposed", 0)  # scenarios the generator wrote, kept or not
        self.duplicates = stats.get("duplicates", 0)
        self.invalid = stats.get("invalid", 0)  # wrong length, broken JSON, missing fields

    @property
    def duplicate_rate(self) -> float:
        return self.duplicates / self.proposed if self.proposed else 0.0

    def summary(self) -> str:
        return (
            f"{len(self)} scenarios from {self.requests} requests: {self.proposed} proposed, "
            f"{self.duplicates} duplicates, {self.invalid} invalid"
        )


def normalize_text(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed: "Hello,  World!" -> "hello world"."""
    return " ".join(re.findall(r"\w+", text.lower()))


def token_set_similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' word sets, from 0 (no word shared) to 1 (same words)."""
    sa, sb = set(normalize_text(a).split()), set(normalize_text(b).split())
    if not sa and not sb:
        return 1.0
    return len(sa & sb) / len(sa | sb)


def is_duplicate(text: str, kept: Iterable[str], similarity: float = DEFAULT_SIMILARITY) -> bool:
    """True when `text` equals a kept text once normalised, or shares at least `similarity` of its words."""
    norm = normalize_text(text)
    return any(norm == normalize_text(k) or token_set_similarity(text, k) >= similarity for k in kept)


def dedupe(texts: Iterable[str], similarity: float = DEFAULT_SIMILARITY) -> list[str]:
    """The texts without repeats and near-repeats, first occurrence kept, order kept.

    >>> dedupe(["Where is my order?", "where is my order", "My parcel never arrived."])
    ['Where is my order?', 'My parcel never arrived.']
    """
    if not 0 < similarity <= 1:
        raise ValueError(
            f"similarity={similarity}: choose a Jaccard threshold in (0, 1]; 1 = exact words only"
        )
    kept: list[str] = []
    for text in texts:
        if not is_duplicate(text, kept, similarity):
            kept.append(text)
    return kept


def system_prompt_for(task_description: str) -> str:
    """The policy's system prompt: the task description, and that the user's message is the input."""
    return (
        f"{task_description.strip()}\n\n"
        "The user's message is the input. Reply with your answer to it only, no preamble."
    )


async def generate_scenarios(
    task_description: str,
    n: int,
    *,
    model: Model | str | None = None,
    batch_size: int = 5,
    concurrency: int = 4,
    max_requests: int | None = None,
    temperature: float = 1.0,
    seed: int | None = 0,
    similarity: float = DEFAULT_SIMILARITY,
    max_task_chars: int = MAX_TASK_CHARS,
    examples: Sequence[str] = (),
    max_tokens: int | None = None,
    allow_fewer: bool = False,
    extra_litellm_params: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> GeneratedScenarios:
    """`n` distinct scenarios (inputs) for the task, written by a generator model.

    >>> scenarios = await generate_scenarios("Reply kindly to a customer's complaint", 20,
    ...                                      model=model.as_base_model())
    >>> scenarios[0].task, scenarios.summary()

    model: an `art.Model` (its endpoint, schema enforced while decoding), or a litellm model string
        ("openai/gpt-4o-mini"); None uses "openai/gpt-4o-mini" when OPENAI_API_KEY is set.
    batch_size: scenarios asked for per request. concurrency: requests in flight at once.
    max_requests: give up after this many requests; default 3 * ceil(n / batch_size) + 2.
    temperature, seed: sampling; request i uses seed + i, so a rerun asks the same questions.
    similarity: token-set Jaccard threshold for near-duplicates (1 keeps all but exact repeats).
    max_task_chars: longest scenario text kept (enforced while decoding on artnb's engines); shorter is faster.
    examples: a few inputs you wrote, shown to the generator as the kind wanted (small models need them);
        copies of them count as duplicates.
    max_tokens: per request; default enough for `batch_size` scenarios of `max_task_chars`.
    allow_fewer: when the requests run out, warn and return what was kept instead of raising.
    extra_litellm_params: more `litellm.acompletion` arguments for a string model (api_base, api_key...).
    """
    if not task_description or not task_description.strip():
        raise ValueError("task_description is empty: describe the task in a sentence or two")
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one scenario")
    if batch_size < 1 or concurrency < 1:
        raise ValueError(f"batch_size={batch_size}, concurrency={concurrency}: both must be at least 1")
    if not 0 < similarity <= 1:
        raise ValueError(f"similarity={similarity}: choose a Jaccard threshold in (0, 1]")
    if not MIN_TASK_CHARS <= max_task_chars <= MAX_TASK_CHARS:
        raise ValueError(
            f"max_task_chars={max_task_chars}: choose from {MIN_TASK_CHARS} to {MAX_TASK_CHARS} (Scenario's bounds)"
        )
    examples = [examples] if isinstance(examples, str) else list(examples)
    generator = _default_generator() if model is None else model
    if not isinstance(generator, (Model, str)):
        raise TypeError(
            f"model must be an art.Model or a litellm model string, got {type(generator).__name__}"
        )
    max_requests = max_requests if max_requests is not None else 3 * math.ceil(n / batch_size) + 2
    if max_requests < 1:
        raise ValueError(f"max_requests={max_requests}: allow at least one request")
    max_tokens = max_tokens or batch_size * (max_task_chars // 2 + 24) + 32
    kept: list[Scenario] = []
    stats = {"requests": 0, "proposed": 0, "duplicates": 0, "invalid": 0}
    reasons: list[str] = []  # why replies or scenarios were unusable; the last one goes in the error
    with tqdm(total=n, desc="scenarios", unit="scenario") as bar:
        while len(kept) < n and stats["requests"] < max_requests:
            wanted = math.ceil((n - len(kept)) / batch_size)
            parallel = min(concurrency, wanted, max_requests - stats["requests"])
            messages = _generation_messages(task_description, batch_size, kept, examples)
            first = stats["requests"]
            replies = await asyncio.gather(
                *(
                    _ask(
                        generator,
                        messages,
                        batch_size,
                        temperature=temperature,
                        seed=None if seed is None else seed + first + i,
                        max_tokens=max_tokens,
                        max_task_chars=max_task_chars,
                        extra=extra_litellm_params,
                        timeout_s=timeout_s,
                    )
                    for i in range(parallel)
                ),
                return_exceptions=True,
            )
            stats["requests"] += parallel
            for reply in replies:
                if isinstance(reply, BaseException):
                    if not isinstance(reply, Exception):
                        raise reply
                    _raise_if_refused(reply, generator)
                    stats["invalid"] += 1
                    reasons.append(f"{type(reply).__name__}: {reply}")
                    continue
                candidates, problems = _parse_reply(reply)
                stats["invalid"] += len(problems)
                reasons.extend(problems)
                for scenario in candidates:
                    if len(kept) >= n:
                        break
                    stats["proposed"] += 1
                    if len(scenario.task) > max_task_chars:
                        stats["invalid"] += 1
                        reasons.append(f"scenario longer than max_task_chars={max_task_chars}")
                        continue
                    if is_duplicate(scenario.task, [*examples, *(k.task for k in kept)], similarity):
                        stats["duplicates"] += 1
                        continue
                    kept.append(scenario)
                    bar.update(1)
            bar.set_postfix(requests=stats["requests"], dupes=stats["duplicates"], invalid=stats["invalid"])
    result = GeneratedScenarios(kept, **stats)
    if len(result) < n:
        why = (
            f"asked for {n} scenarios, got {len(result)} after {result.requests} requests (max_requests="
            f"{max_requests}): {result.proposed} proposed, {result.duplicates} duplicates, {result.invalid} "
            "invalid"
            + (f" (last problem: {reasons[-1][:300]})" if reasons else "")
            + ". Raise max_requests or temperature, raise similarity (1 drops only exact repeats), give "
            "examples, describe the task more concretely, or use a stronger generator model"
        )
        if not allow_fewer or not result:
            raise ScenarioGenerationError(why)
        warnings.warn(why, stacklevel=2)
    return result


def _raise_if_refused(error: Exception, generator: Model | str) -> None:
    """A refused request (HTTP 4xx but 408/409/429: bad key, unknown model) fails the same way every time."""
    status = getattr(error, "status_code", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429):
        name = generator if isinstance(generator, str) else generator.name
        raise ScenarioGenerationError(
            f"the generator {name} refused the request (HTTP {status}: {' '.join(str(error).split())[:300]}). "
            "Check the model name and its API key (or api_base / api_key in extra_litellm_params)"
        ) from error


def _default_generator() -> str:
    if os.environ.get("OPENAI_API_KEY"):
        return "openai/gpt-4o-mini"
    raise ValueError(
        "no generator model: pass model=... , a litellm model string (with its API key set) or an art.Model, "
        "e.g. model.as_base_model() to generate offline with the model you train"
    )


def _generation_messages(
    task_description: str, k: int, kept: Sequence[Scenario], examples: Sequence[str]
) -> list[ChatCompletionMessageParam]:
    system = (
        "You write realistic inputs for training an AI assistant on a task. An input is the message a user "
        "sends; the assistant will answer it. Write only inputs, never answers.\n\n"
        f"The task:\n{task_description.strip()}\n\n"
        f'Reply with JSON: {{"scenarios": [{{"task": "<the user\'s message>", "difficulty": <1 to 5>}}, ...]}} '
        f"with exactly {k} entries. Make them differ in topic, tone, length and difficulty."
    )
    if examples:
        system += "\n\nExamples of inputs of the kind wanted:\n" + "\n".join(f"- {e}" for e in examples)
    user = f"Write {k} new inputs for this task."
    if kept:
        shown = "\n".join(f"- {s.task}" for s in kept[-_AVOID_SHOWN:])
        user += f" These exist already; do not repeat or paraphrase them:\n{shown}"
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _batch_schema(k: int, *, max_chars: int | None) -> dict[str, Any]:
    """JSON schema of a reply with exactly `k` scenarios; `max_chars` adds length bounds to the task (None: none)."""
    item = Scenario.model_json_schema()
    item.pop("title", None)
    for prop in item["properties"].values():
        prop.pop("title", None)
        prop.pop("minLength", None)
        prop.pop("maxLength", None)
    if max_chars is not None:
        item["properties"]["task"].update(minLength=MIN_TASK_CHARS, maxLength=max_chars)
    items = {"type": "array", "items": item, "minItems": k, "maxItems": k}
    return {
        "type": "object",
        "properties": {"scenarios": items},
        "required": ["scenarios"],
        "additionalProperties": False,
    }


async def _ask(
    generator: Model | str,
    messages: list[ChatCompletionMessageParam],
    k: int,
    *,
    temperature: float,
    seed: int | None,
    max_tokens: int,
    max_task_chars: int,
    extra: dict[str, Any] | None,
    timeout_s: float,
) -> str:
    """One request for `k` scenarios; the reply text (JSON, unless a hosted model ignored the schema)."""
    schema = _batch_schema(k, max_chars=max_task_chars if isinstance(generator, Model) else None)
    response_format: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "scenarios", "schema": schema, "strict": True},
    }
    sampling: dict[str, Any] = {"temperature": temperature, "max_tokens": max_tokens}
    if seed is not None:
        sampling["seed"] = seed
    if isinstance(generator, Model):
        name = generator.get_inference_name(await generator.get_step() if generator.trainable else None)
        completion = await asyncio.wait_for(
            generator.openai_client().chat.completions.create(
                model=name, messages=messages, response_format=response_format, **sampling
            ),
            timeout_s,
        )
    else:
        import litellm

        call = litellm.acompletion(
            model=generator,
            messages=messages,
            response_format=response_format,
            **{**sampling, **(extra or {})},
            timeout=timeout_s,
            num_retries=0,
        )
        completion = cast("litellm.ModelResponse", await asyncio.wait_for(call, timeout_s))  # not streamed
        costs.record("autorl/scenarios", completion, model=generator)
    return completion.choices[0].message.content or ""


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _parse_reply(content: str) -> tuple[list[Scenario], list[str]]:
    """The valid scenarios of one reply, and a description of each unusable part."""
    fenced = _FENCE.match(content)
    try:
        data = json.loads(fenced.group(1) if fenced else content)
    except json.JSONDecodeError as error:
        return [], [f"reply is not JSON ({error.msg} at {error.pos}): {content[:120]!r}"]
    entries = data.get("scenarios") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        return [], [f'reply has no "scenarios" list: {content[:120]!r}']
    found, problems = [], []
    for entry in entries:
        try:
            found.append(Scenario.model_validate(entry))
        except ValidationError as error:
            first = error.errors()[0]
            problems.append(
                f"scenario {str(entry)[:80]!r}: {'.'.join(map(str, first['loc']))} {first['msg']}"
            )
    return found, problems


async def rollout(
    model: Model,
    scenario: Scenario,
    *,
    system_prompt: str,
    step: int | None = None,
    temperature: float = 1.0,
    max_tokens: int = 128,
) -> Trajectory:
    """One answer to one scenario: system prompt, the scenario as the user's message, the model's reply.

    The reply is kept as a `Choice`, so it is trained on; the reward stays 0 until RULER scores the group.
    step: which checkpoint of a TrainableModel answers (None: the latest).

    >>> traj = await rollout(model, Scenario(task="My parcel is late again!", difficulty=2),
    ...                      system_prompt=system_prompt_for("Reply kindly to a customer's complaint"))
    """
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": scenario.task},
    ]
    traj = Trajectory(
        messages_and_choices=list(messages),
        reward=0.0,
        metadata={"scenario": scenario.task, "difficulty": scenario.difficulty},
    )
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        messages=messages,
        temperature=temperature,
        max_tokens=max_tokens,
    )
    traj.messages_and_choices.append(completion.choices[0])
    return traj.finish()


Policy = int | None | Model  # a checkpoint of the trained model (None: its latest), or another model


@dataclass
class Evaluation:
    """Base vs trained on held-out scenarios: one row per answer, and the judged groups behind them."""

    table: pd.DataFrame  # columns: scenario, policy, sample, score, explanation, answer
    groups: list[TrajectoryGroup] = field(default_factory=list)

    @property
    def means(self) -> pd.Series:
        """Mean RULER score per policy, in the order the policies were given."""
        order = list(dict.fromkeys(self.table["policy"]))
        return self.table.groupby("policy", sort=False)["score"].mean().loc[order]

    def _repr_html_(self) -> str:
        return self.means.to_frame("mean RULER score").to_html()


async def evaluate(
    model: TrainableModel,
    scenarios: Sequence[Scenario],
    judge: str | Model | InProcessJudge,
    *,
    system_prompt: str,
    policies: Mapping[str, Policy] | None = None,
    samples: int = 1,
    rubric: str = DEFAULT_RUBRIC,
    temperature: float = 1.0,
    max_tokens: int = 128,
) -> Evaluation:
    """Answer each held-out scenario with every policy and judge all answers to it in ONE RULER group.

    >>> result = await evaluate(model, held_out, judge, system_prompt=system_prompt)
    >>> result.means          # mean score per policy;  result.table: one row per answer

    policies: label -> a step of `model` (int; None for its latest) or another `art.Model`; default
        {"base": model.as_base_model(), "trained": None}.
    samples: answers per policy per scenario (more: less noise, larger groups for the judge).
    judge: anything `art.ruler_score_group` takes (a litellm string, an `art.Model`, `art.LocalJudge()`).
    A scenario whose group the judge cannot score is left out of the table (a warning is logged).
    """

    async def answer(target: Model, step: int | None, scenario: Scenario) -> Trajectory:
        return await rollout(
            target,
            scenario,
            system_prompt=system_prompt,
            step=step,
            temperature=temperature,
            max_tokens=max_tokens,
        )

    return await judge_side_by_side(
        model, scenarios, judge, answer, policies=policies, samples=samples, rubric=rubric
    )


Answer = Callable[[Model, int | None, Any], Awaitable[Trajectory]]


async def judge_side_by_side(
    model: TrainableModel,
    scenarios: Sequence[Any],
    judge: str | Model | InProcessJudge,
    answer: Answer,
    *,
    policies: Mapping[str, Policy] | None = None,
    samples: int = 1,
    rubric: str = DEFAULT_RUBRIC,
) -> Evaluation:
    """What `evaluate` does, for any rollout: `answer(target, step, scenario)` plays one scenario (anything with
    a `task`) with a model (and a step of it, or None) and returns the trajectory whose last message is judged.
    Every policy's answers to a scenario go to the judge in ONE group (see `evaluate`)."""
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("evaluate() needs at least one held-out scenario")
    if samples < 1:
        raise ValueError(f"samples={samples}: need at least one answer per policy")
    policies = dict(policies) if policies is not None else {"base": model.as_base_model(), "trained": None}
    if not policies:
        raise ValueError("policies is empty: pass e.g. {'base': model.as_base_model(), 'trained': None}")

    async def one(label: str, policy: Policy, scenario: Any, sample: int) -> Trajectory:
        target, step = (policy, None) if isinstance(policy, Model) else (model, policy)
        traj = await answer(target, step, scenario)
        traj.metadata.update(scenario=scenario.task, policy=label, sample=sample)
        return traj

    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(
                one(label, policy, scenario, i) for label, policy in policies.items() for i in range(samples)
            )
            for scenario in scenarios
        ),
        pbar_desc="evaluate",
        after_each=lambda g: ruler_score_group(g, judge, rubric=rubric, swallow_exceptions=True),
    )
    rows = [
        {
            "scenario": t.metadata["scenario"],
            "policy": t.metadata["policy"],
            "sample": t.metadata["sample"],
            "score": t.reward,
            "explanation": t.metadata.get("ruler_explanation", ""),
            "answer": t.messages()[-1].get("content") or "",
        }
        for g in groups
        for t in g.trajectories
    ]
    if not rows:
        raise RulerError(
            "the judge scored none of the evaluation groups; see the warnings above, or call "
            "art.ruler_score_group on one group with debug=True to see its replies"
        )
    return Evaluation(pd.DataFrame(rows), list(groups))
