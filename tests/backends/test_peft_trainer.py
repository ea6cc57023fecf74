"""PeftTrainer on a tiny random Llama: the update direction, exact micro-batching, checkpoints, KL, checkpointing."""

import json
import math
import random
from dataclasses import replace

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


def with_shared_prompt(sequences: list[TokenizedSequence], length: int = 24) -> list[TokenizedSequence]:
    """The same sequences behind one shared, untrained prompt of `length` tokens (a system prompt)."""
    prompt = [random.Random(7).randrange(100, 40000) for _ in range(length)]
    return [
        replace(
            s,
            token_ids=prompt + s.token_ids,
            assistant_mask=[False] * length + s.assistant_mask,
            logprobs=[math.nan] * length + s.logprobs,
        )
        for s in sequences
    ]


@pytest.mark.parametrize(
    "options",
    [{}, {"logprob_calculation_chunk_size": 8}, {"kl_penalty_coef": 0.1, "precalculate_logprobs": True}],
    ids=["plain", "chunked", "kl+precalculated"],
)
def test_a_shared_prompt_runs_once_and_gives_the_same_update(tiny, options):
    """share_prefixes runs the prompt all rows of a micro-batch share once; the loss, gradient and metrics are
    those of running every row whole."""
    sequences = with_shared_prompt(make_sequences(6, seed=5))
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0, **options)
    gradients, metrics = [], []
    for share in (True, False):
        trainer = PeftTrainer(tiny, LORA, TrainerConfig(share_prefixes=share))
        trainer.train(with_shared_prompt(make_sequences(6, seed=6)), config, progress=False)
        steps = capture_gradients(trainer)
        metrics.append(trainer.train(sequences, config, progress=False))
        gradients.append(steps[0])
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-5, abs=1e-7)
    assert metrics[0]["grad_norm"] == pytest.approx(metrics[1]["grad_norm"], rel=1e-5)
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
    with pytest.raises(
        ValueError,
        match="no trainable tokens in any of the 1 sequences.*or every sampled completion is empty",
    ):
        trainer.train([untrainable], config)
    too_long = make_sequences(1)[0]
    too_long.token_ids = [5] * (trainer.max_seq_length + 1)
    too_long.assistant_mask = [True] * len(too_long.token_ids)
    too_long.logprobs = [math.nan] * len(too_long.token_ids)
    with pytest.raises(ValueError, match="context length"):
        trainer.train([too_long], config)


# --- ART's training knobs -------------------------------------------------------------------------------------


def with_engine_logprobs(
    trainer: PeftTrainer, sequences: list[TokenizedSequence], shift
) -> list[TokenizedSequence]:
    """Copies whose sampling logprobs are the trainer's own (adapter on, eval mode) minus shift(i, j) on the mask."""
    own = trainer.token_logprobs([s.token_ids for s in sequences])
    return [
        replace(
            seq,
            logprobs=[
                lp - shift(i, j) if m else math.nan
                for j, (lp, m) in enumerate(zip(lps, seq.assistant_mask, strict=True))
            ],
        )
        for i, (seq, lps) in enumerate(zip(sequences, own, strict=True))
    ]


def test_chunked_logprobs_equal_the_one_shot_ones(tiny):
    trainer = PeftTrainer(tiny, LORA)
    trainer.train(make_sequences(4, seed=10), TrainConfig(learning_rate=1e-2), progress=False)  # lora_B != 0
    batch = trainer._micro_batches(make_sequences(4, seed=11), 4096)[0]
    assert batch.targets.numel() > 3 * 7
    for adapter in (True, False):
        one_shot = trainer._logprobs(batch, adapter=adapter)
        chunked = trainer._logprobs(batch, adapter=adapter, chunk_size=7)
        torch.testing.assert_close(chunked, one_shot, atol=1e-6, rtol=0)
    assert trainer._chunkable

    # a whole step: the same gradient (each chunk is recomputed in backward)
    gradients = []
    for chunk in (None, 7):
        fresh = PeftTrainer(tiny, LORA)
        fresh.train(make_sequences(4, seed=10), TrainConfig(learning_rate=1e-2), progress=False)
        steps = capture_gradients(fresh)
        config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0, logprob_calculation_chunk_size=chunk)
        fresh.train(make_sequences(4, seed=11), config, progress=False)
        gradients.append(steps[0])
    assert_same(gradients[0], gradients[1], atol=1e-6)


def test_chunking_keeps_no_full_logits_for_backward(tiny):
    """What backward keeps alive: one-shot, the [rows, positions, vocab] log_softmax; chunked, no vocab-wide
    tensor at all outside the checkpointed chunks (those are recomputed, one at a time)."""
    trainer = PeftTrainer(tiny, LORA)
    batch = trainer._micro_batches(make_sequences(4, seed=11), 4096)[0]
    vocab = trainer.model.get_output_embeddings().weight.shape[0]
    largest = {}
    for chunk in (None, 16):
        sizes = []

        def pack(tensor, sizes=sizes):
            if tensor.dim() and tensor.shape[-1] == vocab:
                sizes.append(tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer._logprobs(batch, chunk_size=chunk).sum().backward()
        largest[chunk] = max(sizes, default=0)
    assert largest[None] >= batch.targets.numel() * vocab
    assert largest[16] == 0


def test_chunking_falls_back_when_logits_are_soft_capped(tmp_path, monkeypatch):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from artnb.core import ignored

    monkeypatch.setattr(ignored, "_reported", set())
    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
    )  # fmt: skip
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    trainer = PeftTrainer(str(tmp_path), LORA)
    sequences = make_sequences(2)
    for seq in sequences:
        seq.token_ids = [t % 512 for t in seq.token_ids]
    batch = trainer._micro_batches(sequences, 4096)[0]
    with pytest.warns(UserWarning, match="logprob_calculation_chunk_size.*Gemma2ForCausalLM"):
        chunked = trainer._logprobs(batch, chunk_size=4)
    assert trainer._chunkable is False
    torch.testing.assert_close(chunked, trainer._logprobs(batch), atol=0, rtol=0)


def test_precalculate_logprobs_takes_the_old_logprobs_from_the_trainer(tiny):
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
    trainers = [PeftTrainer(tiny, LORA) for _ in range(2)]
    for trainer in trainers:  # the same non-zero adapter in both, so "adapter on" matters
        trainer.train(make_sequences(4, seed=12), config, progress=False)
    sequences = make_sequences(4, seed=13)
    engine = with_engine_logprobs(trainers[0], sequences, lambda i, j: 0.5)  # the engine is off by 0.5
    exact = with_engine_logprobs(trainers[1], sequences, lambda i, j: 0.0)  # an engine that matches exactly
    steps = [capture_gradients(t) for t in trainers]
    precalculated = trainers[0].train(
        engine, config.model_copy(update={"precalculate_logprobs": True}), progress=False
    )
    reference = trainers[1].train(exact, config, progress=False)
    assert_same(steps[0][0], steps[1][0])
    assert precalculated["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert precalculated["logprob_mismatch"] == pytest.approx(0.5, abs=1e-4)  # still against the engine's
    assert precalculated["loss"] == pytest.approx(reference["loss"], rel=1e-5)

    # truncated IS then weights by trainer / engine = exp(0.5) = 1.65, capped at 1.2: the loss scales by 1.2
    engine = with_engine_logprobs(trainers[0], sequences, lambda i, j: 0.5)
    precalc = config.model_copy(update={"precalculate_logprobs": True})
    plain = trainers[0].train(engine, precalc, progress=False)
    weighted = trainers[1].train(
        engine, precalc.model_copy(update={"truncated_importance_sampling": 1.2}), progress=False
    )
    assert weighted["loss"] == pytest.approx(1.2 * plain["loss"], rel=1e-4)


def test_sequence_level_ratio_is_per_sequence_across_micro_batches(tiny):
    shifts = [0.05, -0.1, 0.15, -0.05]  # one ratio exp(shift) for all the tokens of a sequence
    sequences = make_sequences(4, seed=14)
    gradients = {}
    for level, budget, shift in [
        ("token", 4096, lambda i, j: shifts[i]),
        ("sequence", 4096, lambda i, j: shifts[i]),
        ("sequence", 64, lambda i, j: shifts[i]),
        ("sequence", 4096, lambda i, j: 0.15 if j % 2 else -0.15),  # token ratios 1.16 / 0.86, mean ~1
    ]:
        trainer = PeftTrainer(tiny, LORA)
        trainer.train(make_sequences(4, seed=15), TrainConfig(learning_rate=1e-2), progress=False)
        batch = with_engine_logprobs(trainer, sequences, shift)
        config = TrainConfig(
            learning_rate=1e-2, loss_fn="ppo", max_grad_norm=100.0, micro_batch_tokens=budget,
            importance_sampling_level=level,
        )  # fmt: skip
        steps = capture_gradients(trainer)
        metrics = trainer.train(batch, config, progress=False)
        gradients[len(gradients)] = steps[0]
        if len(gradients) == 3:
            assert metrics["num_micro_batches"] >= 2
    assert_same(gradients[0], gradients[1])  # equal ratios within each sequence: the levels agree
    assert_same(gradients[1], gradients[2])  # and a sequence's ratio does not depend on the micro-batching
    with pytest.raises(AssertionError):
        assert_same(gradients[0], gradients[3])


def test_verbose_prints_the_steps_metrics(tiny, capsys):
    trainer = PeftTrainer(tiny, LORA)
    trainer.train(make_sequences(2), TrainConfig(learning_rate=1e-2), progress=False)
    assert "artnb train" not in capsys.readouterr().out
    trainer.train(make_sequences(2), TrainConfig(learning_rate=1e-2, verbose=True), progress=False)
    out = capsys.readouterr().out
    assert out.startswith("artnb train: loss=") and "grad_norm=" in out and "learning_rate=0.01" in out


def test_advantage_balance_and_the_trajectory_count_learning_rate(tiny):
    sequences = make_sequences(4, seed=16)  # advantages -1, +1, -1, +1
    without_negatives = [replace(s, advantage=max(s.advantage, 0.0)) for s in sequences]
    gradients, metrics = [], []
    for batch, options in [
        (sequences, {"advantage_balance": 1.0, "num_trajectories_learning_rate_multiplier_power": 0.5}),
        (without_negatives, {}),
    ]:
        trainer = PeftTrainer(tiny, LORA)
        trainer.train(make_sequences(4, seed=17), TrainConfig(learning_rate=1e-2), progress=False)
        steps = capture_gradients(trainer)
        metrics.append(
            trainer.train(
                batch, TrainConfig(learning_rate=1e-2, max_grad_norm=100.0, **options), progress=False
            )
        )
        gradients.append(steps[0])
    assert_same(gradients[0], gradients[1])  # b = 1: negative advantages count for nothing
    assert metrics[0]["learning_rate"] == pytest.approx(1e-2 * 4**0.5)  # 4 trajectories, power 0.5
    assert metrics[1]["learning_rate"] == 1e-2


def test_trainers_built_in_threads_at_once_are_whole(tiny):
    """Trainers are built on their models' own threads, the LocalJudge on another: building models at once must
    not leave any (or any later one) with empty meta-device weights (transformers patches torch process-wide
    while it loads)."""
    from concurrent.futures import ThreadPoolExecutor

    from artnb.local_judge import _load_once

    def build(_: int) -> int:
        trainer = PeftTrainer(tiny, LoRAConfig(r=2))
        return sum(p.is_meta for p in trainer.model.parameters())

    with ThreadPoolExecutor(3) as pool:
        judge = pool.submit(_load_once, tiny)
        assert list(pool.map(build, range(8))) == [0] * 8
        assert not any(p.is_meta for p in judge.result()[1].parameters())
    assert not any(p.is_meta for p in PeftTrainer(tiny, LoRAConfig(r=2)).model.parameters())
