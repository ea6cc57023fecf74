"""The FSDP trainer attached to ranks that torchrun started, as on a multi-node cluster (skypilot.py), here one
node of 2 gloo ranks: the same torchrun flags as the SkyPilot run script (static rendezvous at the head's
address, `--max-restarts`), a step equal to the single-process one, and a rank killed mid-step: the step fails,
torchrun restarts the group, and the next step trains from the last checkpoint.
"""

import os
import secrets
import socket
import subprocess
import sys
import threading

import psutil
import pytest
from test_fsdp_trainer import LORA, LORA_TOLERANCE, kill_once_busy, lora_weights, max_abs_diff
from test_peft_trainer import make_sequences

from artnb import models
from artnb.backends.placement import FSDP_AUTHKEY_ENV, FSDP_CONTROL_ENV
from artnb.backends.ports import free_port
from artnb.backends.skypilot import TORCHRUN_MAX_RESTARTS
from artnb.backends.trainers.fsdp_trainer import FsdpTrainer, RankFailed
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.config import TrainConfig, TrainerConfig


@pytest.fixture
def torchrun(tmp_path, monkeypatch):
    """torchrun with 2 ranks of fsdp_rank.py and the run script's flags; yields the agent's process."""
    control = f"127.0.0.1:{free_port()}"
    key = secrets.token_hex(32)
    monkeypatch.setenv(FSDP_CONTROL_ENV, control)  # how `artnb serve` on the head node finds rank 0
    monkeypatch.setenv(FSDP_AUTHKEY_ENV, key)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--node-rank=0",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--max-restarts={TORCHRUN_MAX_RESTARTS}",
        "-m",
        "artnb.backends.trainers.fsdp_rank",
    ]
    env = {"OMP_NUM_THREADS": "1", FSDP_CONTROL_ENV: control, FSDP_AUTHKEY_ENV: key}
    with open(tmp_path / "torchrun.log", "wb") as log:
        agent = subprocess.Popen(command, env={**os.environ, **env}, stdout=log, stderr=log)
    yield agent
    agent.terminate()
    try:
        agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def ranks_of(agent: subprocess.Popen) -> list[int]:
    """The pids of torchrun's workers: the agent's python children running fsdp_rank."""
    children = psutil.Process(agent.pid).children(recursive=True)
    return [c.pid for c in children if "artnb.backends.trainers.fsdp_rank" in " ".join(c.cmdline())]


def test_attached_to_torchrun_trains_and_survives_a_killed_rank(torchrun, tmp_path):
    tiny = models.tiny()
    trainer = FsdpTrainer(tiny, LORA, TrainerConfig(device="cpu"))  # attaches: ARTNB_FSDP_CONTROL is set
    try:
        assert trainer.attach is not None and trainer.ranks == 2 and trainer.rank_pids() == []
        peft = PeftTrainer(tiny, LORA)
        peft.train(make_sequences(4, seed=2), TrainConfig(learning_rate=1e-2), progress=False)
        peft.save_checkpoint(tmp_path / "start")
        trainer.load_checkpoint(tmp_path / "start")
        config = TrainConfig(learning_rate=1e-2, max_grad_norm=100.0)
        sequences = make_sequences(5, seed=1)
        trainer.train(sequences, config)
        peft.train(sequences, config, progress=False)
        assert (
            max_abs_diff(lora_weights(trainer, tmp_path / "a"), lora_weights(peft, tmp_path / "b"))
            < LORA_TOLERANCE
        )

        # Kill rank 1 mid-step: the step fails (rank 0 closes the connection), torchrun restarts both ranks.
        first = ranks_of(torchrun)
        assert len(first) == 2
        killer = threading.Thread(target=kill_once_busy, args=(first[1],))
        killer.start()
        with pytest.raises(RankFailed, match="rank 0 closed its connection during train"):
            trainer.train(make_sequences(384, seed=8), TrainConfig(learning_rate=1e-2, micro_batch_tokens=64))
        killer.join()

        # The next step reaches the restarted group, which loads the last checkpoint, and trains as the
        # PeftTrainer does from the same files.
        sequences = make_sequences(4, seed=9)
        trainer.train(sequences, config)
        assert torchrun.poll() is None and not set(ranks_of(torchrun)) & set(first)
        peft.train(sequences, config, progress=False)
        assert (
            max_abs_diff(lora_weights(trainer, tmp_path / "c"), lora_weights(peft, tmp_path / "d"))
            < LORA_TOLERANCE
        )
    finally:
        trainer.close()


def test_attaching_where_a_program_accepts_and_never_answers_times_out_naming_the_address(monkeypatch):
    """ARTNB_FSDP_CONTROL pointing at another program (here a socket that accepts and stays silent, as an HTTP
    server does) is a TimeoutError naming the address and the likely causes, not a hang."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        monkeypatch.setenv(FSDP_AUTHKEY_ENV, secrets.token_hex(32))
        with pytest.raises(
            TimeoutError,
            match=rf"did not answer on 127.0.0.1:{port} within 2 s: .*another program holds that port",
        ):
            FsdpTrainer(
                models.tiny(),
                LORA,
                TrainerConfig(device="cpu"),
                attach=f"127.0.0.1:{port}",
                start_timeout_s=2,
            )
