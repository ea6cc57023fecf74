"""The FSDP trainer on 2 gloo ranks with the tiny model: the same update as the PeftTrainer, checkpoints that
move between 2 ranks and 1 process, a rank killed mid-step; and where GPUs would go (placement).

One group of ranks serves the whole module (starting two ranks costs ~15 s on 2 cores); each test starts both
trainers from the same checkpoint, so the tests do not depend on their order.
"""

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from test_peft_trainer import make_sequences
from tiny_loop import gather

import artnb as art
from artnb import models
from artnb.backends.placement import plan_placement
from artnb.backends.trainers.choice import make_trainer
from artnb.backends.trainers.fsdp_trainer import FsdpTrainer, RankFailed
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.config import LoRAConfig, TrainConfig, TrainerConfig
from artnb.core.contracts import Trainer

LORA = LoRAConfig(r=4, alpha=8)
GIB = 2**30


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


@pytest.fixture(scope="module")
def fsdp(tiny):
    trainer = make_trainer("fsdp", tiny, LORA, TrainerConfig(device="cpu"))
    yield trainer
    trainer.close()


def lora_weights(trainer: Trainer, path) -> dict[str, torch.Tensor]:
    trainer.save_checkpoint(path)
    return load_file(path / "adapter_model.safetensors")


# How far two trainers' LoRA weights may differ after the same steps at learning rate 1e-2. Adam's first step
# moves a weight by lr * g / (|g| + eps): for a gradient near 0 that is 1e6 times the gradient's own rounding, and
# summing in another order (two ranks, gloo) changes that rounding. Seen: 2e-7 to 5e-6, once just over 1e-5. A real
# error flips some update's sign (a difference of ~lr) or shows in the loss and grad_norm compared beside it.
LORA_TOLERANCE = 1e-4


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def both_from(tiny, fsdp: FsdpTrainer, path) -> PeftTrainer:
    """A PeftTrainer after one step, checkpointed to `path`, and the FSDP ranks loaded from it (1 -> 2)."""
    peft = PeftTrainer(tiny, LORA)
    peft.train(make_sequences(4, seed=2), TrainConfig(learning_rate=1e-2), progress=False)  # lora_B non-zero
    peft.save_checkpoint(path)
    fsdp.load_checkpoint(path)
    return peft


def kill_once_busy(pid: int, cpu_ticks: int = 10) -> None:
    """SIGKILL `pid` once it has used `cpu_ticks` more CPU ticks than now: an idle rank uses none, so it dies
    while training."""

    def ticks() -> int:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    start, deadline = ticks(), time.monotonic() + 60
    while ticks() - start < cpu_ticks and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)


def test_is_a_trainer_on_two_ranks(fsdp, capsys):
    assert isinstance(fsdp, FsdpTrainer) and isinstance(fsdp, Trainer)
    assert fsdp.ranks == 2 and len(fsdp.rank_pids()) == 2
    assert fsdp.max_seq_length == 2048


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_fn": "ppo", "kl_penalty_coef": 0.1, "precalculate_logprobs": True},
        # the head apart from the decoder, and several passes per step (each rank gathers the root per pass)
        {"logprob_calculation_chunk_size": 4, "kl_penalty_coef": 0.1, "micro_batch_tokens": 64},
    ],
    ids=["cispo", "ppo+kl+precalculated", "chunked+kl"],
)
def test_one_grpo_step_equals_the_single_process_one(tiny, fsdp, tmp_path, options):
    peft = both_from(tiny, fsdp, tmp_path / "start")
    sequences = make_sequences(9, seed=1)  # 9 sequences: the ranks get unequal shares
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0, **options)
    ours, theirs = fsdp.train(sequences, config), peft.train(sequences, config, progress=False)
    for name in ("loss", "policy_loss", "grad_norm", "num_trainable_tokens", "learning_rate", "ratio_mean"):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-7), name
    diff = max_abs_diff(lora_weights(fsdp, tmp_path / "fsdp"), lora_weights(peft, tmp_path / "peft"))
    print(f"GRPO {options}: max |LoRA(2 ranks) - LoRA(1 process)| = {diff:.3g}")
    assert diff < LORA_TOLERANCE


def test_one_sft_step_equals_the_single_process_one(tiny, fsdp, tmp_path):
    peft = both_from(tiny, fsdp, tmp_path / "start")
    sequences = make_sequences(3, seed=4)
    ours = fsdp.train_sft(sequences, 1e-2, micro_batch_tokens=32)
    theirs = peft.train_sft(sequences, 1e-2, micro_batch_tokens=32)
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert ours["num_micro_batches"] == theirs["num_micro_batches"] == 3
    diff = max_abs_diff(lora_weights(fsdp, tmp_path / "fsdp"), lora_weights(peft, tmp_path / "peft"))
    print(f"SFT: max |LoRA(2 ranks) - LoRA(1 process)| = {diff:.3g}")
    assert diff < LORA_TOLERANCE


def test_resume_from_2_ranks_to_1_process_and_back(tiny, fsdp, tmp_path):
    """2 ranks train and save; a PeftTrainer resumes from that (moments included) and saves; the ranks resume
    from the PeftTrainer's checkpoint: each next step equals the one the other side takes from the same files."""
    both_from(tiny, fsdp, tmp_path / "start")
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
    fsdp.train(make_sequences(4, seed=5), config)
    fsdp.save_checkpoint(tmp_path / "from2")
    single = PeftTrainer(tiny, LORA)
    single.load_checkpoint(tmp_path / "from2")  # 2 -> 1
    single.train(make_sequences(4, seed=6), config, progress=False)
    single.save_checkpoint(tmp_path / "from1")
    fsdp.load_checkpoint(tmp_path / "from1")  # 1 -> 2
    fsdp.train(make_sequences(4, seed=7), config)
    single.train(make_sequences(4, seed=7), config, progress=False)
    assert (
        max_abs_diff(lora_weights(fsdp, tmp_path / "a"), lora_weights(single, tmp_path / "b"))
        < LORA_TOLERANCE
    )
    saved = torch.load(tmp_path / "a" / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == sum(p.requires_grad for p in single.model.parameters())


def test_a_rank_killed_mid_step_fails_the_step_and_the_next_step_trains(tiny, fsdp, tmp_path):
    peft = both_from(tiny, fsdp, tmp_path / "last-commit")
    victim = fsdp.rank_pids()[1]
    log = fsdp.rank_logs()[1]
    big = make_sequences(384, seed=8)  # ~100 micro-batches per rank: the kill lands mid-step
    config = TrainConfig(learning_rate=1e-2, micro_batch_tokens=64)
    killer = threading.Thread(target=kill_once_busy, args=(victim,))
    killer.start()
    started = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank 1 was killed by signal 9 during train\. Its log: {log}"):
        fsdp.train(big, config)
    killer.join()
    assert time.monotonic() - started < 30  # found by watching the processes, not by a collective's timeout
    assert fsdp.rank_pids() == []  # the other rank was stopped too

    # The next step starts two new ranks, which load the last checkpoint, and trains as the PeftTrainer does.
    sequences = make_sequences(4, seed=9)
    config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
    fsdp.train(sequences, config)
    assert len(fsdp.rank_pids()) == 2 and victim not in fsdp.rank_pids()
    peft.train(sequences, config, progress=False)
    assert (
        max_abs_diff(lora_weights(fsdp, tmp_path / "fsdp"), lora_weights(peft, tmp_path / "peft"))
        < LORA_TOLERANCE
    )


def test_bad_batches_and_checkpoints_raise_here_and_the_ranks_live_on(fsdp, tmp_path):
    with pytest.raises(ValueError, match="no sequences"):
        fsdp.train([], TrainConfig())
    with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
        fsdp.load_checkpoint(tmp_path)
    pids = fsdp.rank_pids()
    fsdp.reset_optimizer()
    fsdp.free_memory()
    assert fsdp.rank_pids() == pids


@pytest.mark.parametrize(
    "gpus, model_gib, gpu_gib, split, serve, train, tp, dp",
    [
        (0, 1, 80, False, (), (), 1, 1),  # a CPU: gloo ranks
        (1, 3, 80, False, (0,), (0,), 1, 1),  # one GPU: colocated, as LocalBackend always did
        (8, 15, 80, False, tuple(range(8)), tuple(range(8)), 1, 8),  # 7B: 8 vLLM replicas, 8 ranks
        (8, 140, 80, False, tuple(range(8)), tuple(range(8)), 4, 2),  # 70B: tensor parallel 4
        (8, 15, 80, True, (0, 1, 2, 3), (4, 5, 6, 7), 1, 4),  # split: half serve, half train
        (16, 140, 80, True, tuple(range(8)), tuple(range(8, 16)), 4, 2),  # two nodes, split
    ],
)
def test_placement(gpus, model_gib, gpu_gib, split, serve, train, tp, dp):
    placement = plan_placement(gpus, model_gib * GIB, gpu_gib * GIB, split=split)
    assert (placement.serve_gpus, placement.train_gpus) == (serve, train)
    assert (placement.tensor_parallel_size, placement.data_parallel_size) == (tp, dp)
    assert placement.colocated == (not split)
    assert placement.vllm_args()[1:4:2] == [str(tp), str(dp)]


def test_placement_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="do not fit half the memory of the 8 serving GPUs"):
        plan_placement(8, 700 * GIB, 80 * GIB)
    with pytest.raises(ValueError, match=r"of the 1 serving GPUs .*, or split=False"):
        plan_placement(2, 50 * GIB, 80 * GIB, split=True)  # fits both GPUs colocated, not one
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        plan_placement(1, GIB, 80 * GIB, split=True)


async def test_local_backend_trains_on_fsdp_ranks_and_stops_them(tmp_path, capsys):
    """`LocalBackend(trainer="fsdp")`: the placement is said at register, a step trains on the ranks and commits,
    the ranks' logs are in the run's logs folder, and closing the backend stops the ranks."""
    model = art.TrainableModel(name="fsdp", project="tests", base_model=models.tiny(), lora=LORA)
    async with art.LocalBackend(path=tmp_path, engine="hf", trainer="fsdp") as backend:
        await model.register(backend)
        assert "2 gloo trainer ranks" in capsys.readouterr().out
        trainer = backend.trainer_of(model)
        assert isinstance(trainer, FsdpTrainer)
        result = await model.train(await gather(model, seed=1), learning_rate=1e-2)
        assert result.step == 1 and await model.get_step() == 1
        assert [log.parent for log in trainer.rank_logs()] == [model.store.logs] * 2
        pids = trainer.rank_pids()
        assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped
