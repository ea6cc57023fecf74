"""PeftTrainer on a tiny random Llama: the update direction, exact micro-batching, checkpoints, KL, checkpointing."""

import json
import math
import random

import pytest
import torch

from artnb import models
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.config import LoRAConfig, TrainConfig, TrainerConfig
from artnb.core.tokenize import TokenizedSequence

LORA = LoRAConfig(r=4, alpha=8)


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


def make_sequences(
    count: int = 4, seed: int = 0, advantages: list[float] | None = None
) -> list[TokenizedSequence]:
    """Random token ids; the second half of each sequence is the trainable completion."""
    rng = random.Random(seed)
    sequences = []
    for i in range(count):
        n = rng.randint(10, 20)
        prompt = n // 2
        sequences.append(
            TokenizedSequence(
                token_ids=[rng.randrange(100, 40000) for _ in range(n)],
                assistant_mask=[j >= prompt for j in range(n)],
                logprobs=[math.nan] * n,
                advantage=advantages[i] if advantages else (1.0 if i % 2 else -1.0),
                group_index=0,
                trajectory_index=i,
            )
        )
    return sequences


@torch.no_grad()
def forward_logprobs(model: torch.nn.Module, seq: TokenizedSequence) -> list[float]:
    """The model's own logprob of each token given the ones before (NaN for the first), via a plain forward."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([seq.token_ids])
    logits = model(input_ids=ids).logits[0, :-1]
    values = logits.log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
    model.train(was_training)
    return [math.nan, *values]


def mean_trainable_logprob(model: torch.nn.Module, sequences: list[TokenizedSequence]) -> float:
    values = [
        lp
        for s in sequences
        for lp, m in zip(forward_logprobs(model, s), s.assistant_mask, strict=True)
        if m and not math.isnan(lp)
    ]
    return sum(values) / len(values)


def capture_gradients(trainer: PeftTrainer) -> list[dict[str, torch.Tensor]]:
    """Gradients the optimizer is about to apply, one dict per step (after clipping)."""
    names = {p: n for n, p in trainer.model.named_parameters() if p.requires_grad}
    steps: list[dict[str, torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: steps.append(
            {names[p]: p.grad.clone() for g in opt.param_groups for p in g["params"]}
        )
    )
    return steps


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


def test_update_follows_the_advantage_sign_and_touches_only_lora(tiny):
    trainer = PeftTrainer(tiny, LORA)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    sequences = make_sequences(6)
    positive = [s for s in sequences if s.advantage > 0]
    negative = [s for s in sequences if s.advantage < 0]
    pos_before = mean_trainable_logprob(trainer.model, positive)
    neg_before = mean_trainable_logprob(trainer.model, negative)

    config = TrainConfig(learning_rate=1e-2, max_grad_norm=10.0)
    first = trainer.train(sequences, config, progress=False)
    second = trainer.train(sequences, config, progress=False)

    assert second["loss"] < first["loss"]
    assert mean_trainable_logprob(trainer.model, positive) > pos_before
    assert mean_trainable_logprob(trainer.model, negative) < neg_before
    for name, p in trainer.model.named_parameters():
        if "lora_" in name:
            assert p.requires_grad
        else:
            assert not p.requires_grad
            assert torch.equal(p, base_before[name]), name
    assert any(
        not torch.equal(p, lora_before[n]) for n, p in trainer.model.named_parameters() if "lora_" in n
    )
    expected = sum(sum(s.assistant_mask[1:]) for s in sequences)
    assert first["num_trainable_tokens"] == expected
    assert first["num_sequences"] == 6
    assert first["learning_rate"] == 1e-2
    assert first["tokens_per_second"] > 0 and first["seconds"] > 0
    assert first["grad_norm"] > 0
    assert "kl" not in first and "logprob_mismatch" not in first  # no KL asked, no engine logprobs given


def test_micro_batch_size_does_not_change_the_gradient(tiny):
    sequences = make_sequences(5, seed=1)
    config = TrainConfig(learning_rate=1e-2, loss_fn="ppo", max_grad_norm=100.0)
    gradients, metrics = [], []
    for budget in (64, 4096):
        trainer = PeftTrainer(tiny, LORA)
        trainer.train(make_sequences(5, seed=2), config, progress=False)  # a first step makes lora_B non-zero
        steps = capture_gradients(trainer)
        metrics.append(
            trainer.train(sequences, config.model_copy(update={"micro_batch_tokens": budget}), progress=False)
        )
        gradients.append(steps[0])
    assert metrics[0]["num_micro_batches"] >= 2 and metrics[1]["num_micro_batches"] == 1
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-5)
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-5)
    assert_same(gradients[0], gradients[1])


def test_gradient_checkpointing_gives_the_same_update(tiny):
    sequences = make_sequences(4, seed=3)
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
    gradients = []
    for checkpointing in (False, True):
        trainer = PeftTrainer(tiny, LORA, TrainerConfig(gradient_checkpointing=checkpointing))
        assert trainer.model.get_base_model().is_gradient_checkpointing == checkpointing
        trainer.train(make_sequences(4, seed=4), config, progress=False)
        steps = capture_gradients(trainer)
        trainer.train(sequences, config, progress=False)
        gradients.append(steps[0])
    assert_same(gradients[0], gradients[1])


def test_checkpoint_round_trip(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = PeftTrainer(tiny, LORA)
    trainer.train(make_sequences(4), TrainConfig(learning_rate=1e-2), progress=False)
    trainer.save_checkpoint(tmp_path)
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= {
        p.name for p in tmp_path.iterdir()
    }

    probe = make_sequences(2, seed=5)
    expected = trainer.token_logprobs([s.token_ids for s in probe])
    resumed = PeftTrainer(tiny, LORA)
    assert resumed.token_logprobs([probe[0].token_ids]) != expected[:1]  # a fresh adapter differs
    resumed.load_checkpoint(tmp_path)
    for got, values in zip(resumed.token_logprobs([s.token_ids for s in probe]), expected, strict=True):
        assert got == pytest.approx(values, nan_ok=True, abs=1e-6)

    # what an inference engine does: base model + PeftModel.from_pretrained
    engine_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), str(tmp_path))
    for seq, values in zip(probe, expected, strict=True):
        assert forward_logprobs(engine_model, seq) == pytest.approx(values, nan_ok=True, abs=1e-5)

    # optimizer.pt round-trips: same Adam moments, so the next step is the same too
    saved, loaded = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert saved["state"].keys() == loaded["state"].keys() and saved["state"]
    for key, state in saved["state"].items():
        torch.testing.assert_close(state["exp_avg_sq"], loaded["state"][key]["exp_avg_sq"])
        assert float(state["step"]) == float(loaded["state"][key]["step"]) == 1.0
    next_batch, config = make_sequences(3, seed=6), TrainConfig(learning_rate=1e-2)
    trainer.train(next_batch, config, progress=False)
    resumed.train(next_batch, config, progress=False)
    [after_resumed], [after_original] = (t.token_logprobs([probe[0].token_ids]) for t in (resumed, trainer))
    assert after_resumed == pytest.approx(after_original, nan_ok=True, abs=1e-5)


def test_load_checkpoint_errors(tiny, tmp_path):
    trainer = PeftTrainer(tiny, LORA)
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        trainer.load_checkpoint(tmp_path)
    trainer.save_checkpoint(tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    with pytest.raises(ValueError, match="same LoRAConfig"):
        trainer.load_checkpoint(tmp_path)


def test_logprob_mismatch_is_zero_for_the_models_own_logprobs(tiny):
    trainer = PeftTrainer(tiny, LORA)
    sequences = make_sequences(4, seed=7)
    for seq in sequences:
        own = forward_logprobs(trainer.model, seq)
        seq.logprobs = [lp if m else math.nan for lp, m in zip(own, seq.assistant_mask, strict=True)]
        assert trainer.token_logprobs([seq.token_ids])[0][1:] == pytest.approx(own[1:], abs=1e-5)
    metrics = trainer.train(sequences, TrainConfig(learning_rate=1e-2), progress=False)
    assert metrics["logprob_mismatch"] < 1e-5
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)

    shifted = make_sequences(4, seed=7)
    for seq in shifted:
        seq.logprobs = [
            lp - 0.5 if m else math.nan
            for lp, m in zip(trainer.token_logprobs([seq.token_ids])[0], seq.assistant_mask, strict=True)
        ]
    assert trainer.train(shifted, TrainConfig(learning_rate=1e-2), progress=False)[
        "logprob_mismatch"
    ] == pytest.approx(0.5, abs=1e-4)


def test_models_without_logits_to_keep_get_the_same_logprobs(tiny):
    trainer = PeftTrainer(tiny, LORA)
    ids = [make_sequences(1, seed=9)[0].token_ids]
    selected = trainer.token_logprobs(ids)[0]
    trainer._keeps_logits = False  # as for Whisper or ProphetNet: full logits, then the kept positions
    assert trainer.token_logprobs(ids)[0] == pytest.approx(selected, nan_ok=True, abs=1e-6)


def test_kl_to_the_base_model_grows_after_an_update(tiny):
    trainer = PeftTrainer(tiny, LORA)
    sequences = make_sequences(4, seed=8)
    config = TrainConfig(learning_rate=1e-2, kl_penalty_coef=0.5)
    first = trainer.train(sequences, config, progress=False)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at zero: the adapter is a no-op
    second = trainer.train(sequences, config, progress=False)
    assert second["kl"] > 1e-6
    assert second["loss"] == pytest.approx(second["policy_loss"] + 0.5 * second["kl"], rel=1e-4)


def test_bad_inputs_raise(tiny):
    with pytest.raises(ValueError, match=r"match no module.*linear layers are named"):
        PeftTrainer(tiny, LoRAConfig(target_modules=["c_attn", "c_proj"]))
    with pytest.warns(UserWarning, match="c_attn"):
        PeftTrainer(tiny, LoRAConfig(target_modules=["q_proj", "c_attn"]))

    trainer = PeftTrainer(tiny, LORA)
    config = TrainConfig()
    with pytest.raises(ValueError, match="no sequences"):
        trainer.train([], config)
    bad = make_sequences(1)[0]
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(ValueError, match="lengths"):
        trainer.train([bad], config)
    untrainable = make_sequences(1)[0]
    untrainable.assistant_mask = [True] + [False] * (len(untrainable.token_ids) - 1)
    with pytest.raises(ValueError, match="no trainable tokens"):
        trainer.train([untrainable], config)
    too_long = make_sequences(1)[0]
    too_long.token_ids = [5] * (trainer.max_seq_length + 1)
    too_long.assistant_mask = [True] * len(too_long.token_ids)
    too_long.logprobs = [math.nan] * len(too_long.token_ids)
    with pytest.raises(ValueError, match="context length"):
        trainer.train([too_long], config)
