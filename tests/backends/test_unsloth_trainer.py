"""UnslothTrainer's own code on the CPU, and the checkpoint format both trainers share.

Unsloth loads models only on an NVIDIA GPU, so here the Unsloth trainer gets its model from PEFT's loader
(`PeftLoadedUnslothTrainer`); every other line that runs is UnslothTrainer's: its logprob path (decoder, then
the LM head in chunks), its fp16 loss scaling (with torch's CPU GradScaler), its checkpoint writer and reader.
What stays unexercised is `FastLanguageModel` itself and CUDA autocast: `benchmarks/gpu_check.py` covers those
on a GPU.
"""

import json
import math
import random

import pytest
import torch

from artnb import models
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.backends.trainers.unsloth_trainer import UnslothTrainer, point_adapter_at_base
from artnb.core.config import LoRAConfig, TrainConfig
from artnb.core.tokenize import TokenizedSequence

LORA = LoRAConfig(r=4, alpha=8)
CONFIG = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
FILES = {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"}


class PeftLoadedUnslothTrainer(UnslothTrainer):
    """UnslothTrainer with PEFT's model loader (Unsloth's needs CUDA); the rest is UnslothTrainer's."""

    _load_model = PeftTrainer._load_model


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


def sequences(count: int, seed: int, advantage: float = 1.0) -> list[TokenizedSequence]:
    """Random token ids, the second half trainable, advantages alternating in sign, no engine logprobs."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(10, 24)
        out.append(
            TokenizedSequence(
                token_ids=[rng.randrange(100, 40000) for _ in range(n)],
                assistant_mask=[j >= n // 2 for j in range(n)],
                logprobs=[math.nan] * n,
                advantage=advantage if i % 2 else -advantage,
                group_index=0,
                trajectory_index=i,
            )
        )
    return out


def lora_weights(trainer: PeftTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-5, msg=name)


def test_the_unsloth_logprob_path_gives_peft_trainers_logprobs_and_update(tiny):
    """Decoder + LM head in chunks (whatever the chunk size) is the same computation as PeftTrainer's."""
    batch, probe = sequences(5, seed=1), sequences(2, seed=2)
    peft = PeftTrainer(tiny, LORA)
    expected = peft.token_logprobs([s.token_ids for s in probe])
    peft.train(batch, CONFIG, progress=False)
    for chunk in (None, 3):
        unsloth = PeftLoadedUnslothTrainer(tiny, LORA)
        got = unsloth.token_logprobs([s.token_ids for s in probe])
        for a, b in zip(got, expected, strict=True):
            assert a == pytest.approx(b, nan_ok=True, abs=1e-5)
        unsloth.train(
            batch, CONFIG.model_copy(update={"logprob_calculation_chunk_size": chunk}), progress=False
        )
        assert_same_weights(lora_weights(unsloth), lora_weights(peft), atol=1e-5)


def test_a_checkpoint_written_by_either_trainer_resumes_in_the_other(tiny, tmp_path):
    """Same files, same keys, same weights and AdamW moments: the next step after resuming is the one the
    writer would have taken, in both directions."""
    batch, after = sequences(4, seed=3), sequences(4, seed=4)
    writers = {"peft": PeftTrainer(tiny, LORA), "unsloth": PeftLoadedUnslothTrainer(tiny, LORA)}
    for name, writer in writers.items():
        writer.train(batch, CONFIG, progress=False)
        writer.save_checkpoint(tmp_path / name)
    files = {name: {p.name for p in (tmp_path / name).iterdir()} for name in writers}
    assert files["peft"] == files["unsloth"] and FILES <= files["peft"]
    configs = {name: json.loads((tmp_path / name / "adapter_config.json").read_text()) for name in writers}
    assert configs["peft"] == configs["unsloth"]
    assert configs["unsloth"]["base_model_name_or_path"] == tiny

    readers = {"peft": PeftLoadedUnslothTrainer(tiny, LORA), "unsloth": PeftTrainer(tiny, LORA)}
    for name, reader in readers.items():  # the other kind of trainer reads each checkpoint
        writer = writers[name]
        reader.load_checkpoint(tmp_path / name)
        assert_same_weights(lora_weights(reader), lora_weights(writer))
        saved, loaded = writer.optimizer.state_dict()["state"], reader.optimizer.state_dict()["state"]
        assert saved.keys() == loaded.keys() and saved
        for key in saved:
            torch.testing.assert_close(saved[key]["exp_avg"], loaded[key]["exp_avg"])
            torch.testing.assert_close(saved[key]["exp_avg_sq"], loaded[key]["exp_avg_sq"])
        reader.train(after, CONFIG, progress=False)
        writer.train(after, CONFIG, progress=False)
        assert_same_weights(lora_weights(reader), lora_weights(writer), atol=1e-5)


def test_the_unsloth_writer_names_the_served_base_model(tiny, tmp_path):
    """Unsloth records the weights it loaded, which for a hub id can be a pre-quantised copy; the checkpoint
    must name what the engine serves, as PeftTrainer's do."""
    trainer = PeftLoadedUnslothTrainer(tiny, LORA)
    trainer.save_checkpoint(tmp_path)
    config_path = tmp_path / "adapter_config.json"
    written = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**written, "base_model_name_or_path": "unsloth/tiny-bnb-4bit"}))
    point_adapter_at_base(tmp_path, tiny)
    assert json.loads(config_path.read_text()) == written
    assert models.resolve_base_model(str(tmp_path)) == tiny  # a run can start from it (RL after SFT)
    PeftTrainer(tiny, LORA).load_checkpoint(tmp_path)


def test_fp16_loss_scaling_gives_the_unscaled_update(tiny):
    """The scale multiplies the logprobs' gradient and is divided out before clipping: the update is the one
    without scaling (exact here, in fp32 on the CPU)."""
    batch = sequences(4, seed=5)
    plain, scaled = PeftLoadedUnslothTrainer(tiny, LORA), PeftLoadedUnslothTrainer(tiny, LORA)
    scaled._scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plain_metrics = plain.train(batch, CONFIG, progress=False)
    scaled_metrics = scaled.train(batch, CONFIG, progress=False)
    assert scaled_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-5)
    assert scaled_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-6)
    assert_same_weights(lora_weights(scaled), lora_weights(plain), atol=1e-6)


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale(tiny):
    trainer = PeftLoadedUnslothTrainer(tiny, LORA)
    trainer.train(
        sequences(4, seed=6), CONFIG, progress=False
    )  # lora_B non-zero: gradients reach every weight
    trainer._scaler = torch.amp.GradScaler("cpu", init_scale=3e38)
    before = lora_weights(trainer)
    with pytest.warns(UserWarning, match="overflowed at loss scale 3e\\+38; the update was skipped"):
        # |advantage| 1000: the logprobs' gradient times the scale is beyond fp32
        metrics = trainer.train(sequences(4, seed=7, advantage=1000.0), CONFIG, progress=False)
    assert not math.isfinite(metrics["grad_norm"])
    assert_same_weights(lora_weights(trainer), before, atol=0)
    assert trainer._scaler.get_scale() == pytest.approx(1.5e38)
    assert all(p.grad is None for p in trainer.model.parameters())


def test_the_preset_limits_the_sequence_length(tiny):
    from artnb.backends.gpu_presets import CARDS, choose_preset, model_shape

    preset = choose_preset(CARDS["T4"], model_shape(tiny)).override(max_seq_length=16)
    trainer = PeftLoadedUnslothTrainer(tiny, LORA, preset=preset)
    assert trainer.max_seq_length == 16 and PeftTrainer(tiny, LORA).max_seq_length == 2048
    with pytest.raises(ValueError, match="more than the model's context length 16"):
        trainer.train(sequences(2, seed=8), CONFIG, progress=False)


def test_unsloth_cannot_build_without_cuda(tiny):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        UnslothTrainer(tiny, LORA)
