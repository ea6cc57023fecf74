"""FsdpTrainer: the Trainer that LocalBackend(trainer="fsdp") drives, training on N ranks with FSDP2.

Why: a model whose weights, gradients and AdamW state do not fit one GPU trains when they are sharded across
several (and across nodes). The notebook process keeps the `Trainer` contract (core/contracts.py) and the
run-directory guarantees; the ranks (fsdp_rank.py) run the PeftTrainer's own step on their shards.

Design choices:
- This process starts the ranks of one machine itself, as `python -m artnb.backends.trainers.fsdp_rank` with
  the environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), each writing to its
  own log file. Starting them directly, not through torchrun's agent, is what lets a failure name the rank
  that died and its log. Across nodes torchrun starts them (skypilot.py) and `attach="host:port"` connects to
  rank 0 instead (ARTNB_FSDP_CONTROL in the environment does the same for `artnb serve`).
- One connection, to rank 0 (authenticated with a key made here); rank 0 broadcasts each command. The whole
  step's sequences go to rank 0 and every rank takes its share, so the notebook never splits a batch.
- The sequences are checked here first (the PeftTrainer's checks, shared), so a bad batch raises the same
  ValueError in the notebook and the ranks see only batches they can train on.
- A rank that dies (any exception ends a rank) fails the call with an error naming the rank, its exit code and
  its log file, with the log's last lines. The other ranks are stopped; the next call starts a fresh group and
  loads the last checkpoint this trainer saved or loaded, so the next step trains from the last commit (the
  backend also reloads it after a failed step). Commits stay the backend's: `save_checkpoint` returns once
  rank 0 wrote the files after all ranks gathered them, and the backend renames the directory.
- Backend nccl with one GPU per rank, gloo on the CPU (the tests' two ranks). `ranks=None`: one per GPU the
  placement gives the trainer (placement.py), 2 on a machine without GPUs. The ranks see only those GPUs
  (CUDA_VISIBLE_DEVICES, `rank_environment`): with `TrainerConfig(placement="split")` the second half.
"""

from __future__ import annotations

import atexit
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from ...core.config import LoRAConfig, TrainConfig, TrainerConfig
from ...core.tokenize import TokenizedSequence
from ..cpu_threads import cpu_threads
from ..placement import FSDP_AUTHKEY_ENV as AUTHKEY_ENV
from ..placement import FSDP_CONTROL_ENV as CONTROL_ENV
from ..placement import Placement, local_gpus, plan_placement, visible_devices, weight_bytes
from ..ports import free_port
from .peft_trainer import context_length, grpo_sequences, sft_sequences

_POLL_S = 0.1  # how often a waiting call checks that every rank is still there
# until rank 0 answers: the ranks start and import torch (attached: torchrun's may start later)
_START_TIMEOUT_S = 600.0
_LOG_TAIL_LINES = 20


class RankFailed(RuntimeError):
    """A rank of the FSDP trainer died during a call; the message names it and its log."""


class FsdpTrainer:
    """Trains a LoRA adapter with the GRPO or SFT loss on `ranks` processes, the model sharded by FSDP2.

    Example:
        >>> trainer = FsdpTrainer(artnb.models.tiny(), LoRAConfig(r=4), ranks=2)  # doctest: +SKIP
        >>> trainer.train(sequences, TrainConfig(learning_rate=1e-3))  # one step over all ranks  # doctest: +SKIP
        >>> trainer.save_checkpoint(tmp_dir)  # the PeftTrainer's files: PeftTrainer.load_checkpoint reads them
        >>> trainer.close()
    """

    def __init__(
        self,
        base_model_path: str,
        lora: LoRAConfig | None = None,
        config: TrainerConfig | None = None,
        *,
        ranks: int | None = None,
        log_dir: str | Path | None = None,
        attach: str | None = None,
        placement: Placement | None = None,
        start_timeout_s: float = _START_TIMEOUT_S,
    ) -> None:
        from transformers import AutoConfig

        self.base_model_path = str(base_model_path)
        self.lora = lora or LoRAConfig()
        self.config = config or TrainerConfig()
        self.attach = attach if attach is not None else os.environ.get(CONTROL_ENV) or None
        self.start_timeout_s = start_timeout_s  # how long rank 0 may take to answer
        # Where the local ranks go, planned once (LocalBackend passes the one it printed at register).
        self.placement = placement or local_placement(self.base_model_path, self.config)
        if ranks is None:
            ranks = len(self.placement.train_gpus) or 2  # 2 on a CPU
        if ranks < 1:
            raise ValueError(f"ranks={ranks}: the FSDP trainer needs at least 1 rank")
        self.ranks = ranks
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="artnb-fsdp-"))
        self._max_seq_length = context_length(AutoConfig.from_pretrained(self.base_model_path))
        self._processes: list[subprocess.Popen] = []
        self._conn: Connection | None = None
        self._last_checkpoint: Path | None = None  # what a restarted group loads
        atexit.register(self.close)
        self._start()

    # ----- the Trainer contract ---------------------------------------------------------------------------

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    def train(
        self, sequences: list[TokenizedSequence], config: TrainConfig, *, progress: bool = True
    ) -> dict[str, float]:
        """One optimizer step of the GRPO loss over all `sequences`, shared out to the ranks (PeftTrainer.train)."""
        grpo_sequences(sequences, config, self.max_seq_length)  # the ranks' checks, raised here
        metrics = self._call("train", sequences, config, progress=False)
        if config.verbose:
            print("artnb train: " + ", ".join(f"{name}={value:.4g}" for name, value in metrics.items()))
        return metrics

    def train_sft(
        self,
        sequences: list[TokenizedSequence],
        learning_rate: float,
        *,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        micro_batch_tokens: int = 2048,
    ) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning, shared out to the ranks (PeftTrainer.train_sft)."""
        sft_sequences(sequences, self.max_seq_length)
        return self._call(
            "train_sft",
            sequences,
            learning_rate,
            max_grad_norm=max_grad_norm,
            weight_decay=weight_decay,
            micro_batch_tokens=micro_batch_tokens,
        )

    def save_checkpoint(self, path: str | Path) -> None:
        """The PeftTrainer's files in `path` (adapter + optimizer.pt), gathered from the ranks by rank 0."""
        path = Path(path).resolve()
        self._call("save_checkpoint", str(path))
        self._last_checkpoint = path

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume every rank from a directory written by this trainer or by PeftTrainer.save_checkpoint."""
        path = Path(path).resolve()
        self._call("load_checkpoint", str(path), _reload=False)
        self._last_checkpoint = path

    def reset_optimizer(self) -> None:
        self._call("reset_optimizer")

    def free_memory(self) -> None:
        self._call("free_memory")

    # ----- the ranks --------------------------------------------------------------------------------------

    def rank_logs(self) -> list[Path]:
        """Each local rank's log file, by rank (empty when attached to ranks torchrun started)."""
        return [self.log_dir / f"rank{rank}.log" for rank in range(len(self._processes))]

    def rank_pids(self) -> list[int]:
        """The process id of each local rank, by rank."""
        return [p.pid for p in self._processes]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the ranks: told to, then terminated after `grace_s`."""
        if self._conn is not None:
            try:
                self._conn.send(("stop", (), {}))
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        _stop(self._processes, grace_s)
        self._processes = []

    def _start(self) -> None:
        """Start the ranks (unless attached), connect to rank 0 and have every rank load the model."""
        authkey = secrets.token_bytes(32)
        if self.attach is None:
            address = ("127.0.0.1", free_port())
            self.log_dir.mkdir(parents=True, exist_ok=True)
            gpus = self.placement.train_gpus
            self._processes = _launch(self.ranks, address, authkey, self.log_dir, self.config, gpus)
        else:
            host, port = self.attach.rsplit(":", 1)
            address = (host, int(port))
            authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
        self._conn = self._connect(address, authkey)
        info = self._call("init", self.base_model_path, self.lora, self.config, _reload=False)
        self.ranks = info["world_size"]

    def _connect(self, address: tuple[str, int], authkey: bytes) -> Connection:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._check_ranks("start")
            try:
                return _client(address, authkey, deadline, lambda: self._check_ranks("start"))
            # Refused: rank 0 is not listening yet. Reset, EOF or a failed handshake: something else holds the port
            # (rank 0 then fails to listen, and _check_ranks says so with its log). Timeout: the deadline passed.
            except (
                ConnectionRefusedError,
                FileNotFoundError,
                ConnectionResetError,
                EOFError,
                AuthenticationError,
                TimeoutError,
            ):
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(
                        f"FSDP rank 0 did not answer on {address[0]}:{address[1]} within {self.start_timeout_s:.0f} "
                        f"s: not listening, another program holds that port, or (attached) rank 0 holds another "
                        f"{AUTHKEY_ENV} than this process"
                    ) from None
                time.sleep(_POLL_S)

    def _call(self, command: str, *args: Any, _reload: bool = True, **kwargs: Any) -> Any:
        """Send `command` to the ranks and wait for rank 0's answer, watching that none of them dies."""
        if self._conn is None:
            self._start()
            if _reload and self._last_checkpoint is not None:
                self._call("load_checkpoint", str(self._last_checkpoint), _reload=False)
        conn = self._conn
        assert conn is not None  # _start connected, or raised
        try:
            conn.send((command, args, kwargs))
            while not conn.poll(_POLL_S):
                self._check_ranks(command)
            status, result = conn.recv()
        except (EOFError, OSError) as error:
            time.sleep(1.0)  # let the process that closed the connection be seen to exit
            self._check_ranks(command)
            self.close(grace_s=0.0)
            raise RankFailed(
                f"the FSDP trainer's rank 0 closed its connection during {command} ({error!r}); see the ranks' "
                f"logs (torchrun's, when attached). The next call starts the ranks again"
            ) from error
        if status == "error":
            raise result
        return result

    def _check_ranks(self, command: str) -> None:
        dead = [(rank, p.returncode) for rank, p in enumerate(self._processes) if p.poll() is not None]
        if not dead:
            return
        logs = self.rank_logs()
        self.close(grace_s=0.0)
        # A rank killed by a signal is the cause; the others then fail on the broken collective (code 1).
        dead.sort(key=lambda rank_code: (rank_code[1] >= 0, rank_code[0]))
        rank, code = dead[0]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        others = "".join(f"Rank {r} ended too (code {c}). " for r, c in dead[1:])
        raise RankFailed(
            f"FSDP trainer rank {rank} {how} during {command}. Its log: {logs[rank]}\n{_tail(logs[rank])}\n"
            f"{others}The step was not committed. The other ranks were stopped; the next call starts them again "
            "from the last checkpoint"
        )


def local_placement(
    base_model_path: str, config: TrainerConfig, gpus: tuple[int, int] | None = None
) -> Placement:
    """plan_placement for this machine's GPUs (none when `config.device` is "cpu") and the model's weight files,
    split when `config.placement` is "split". `gpus`: (count, bytes each) of another machine instead, e.g. to
    see on a laptop where a model would go on 8 H100s."""
    count, gpu_bytes = gpus or local_gpus(config.device)
    return plan_placement(count, weight_bytes(base_model_path), gpu_bytes, split=config.placement == "split")


def _client(
    address: tuple[str, int], authkey: bytes, deadline: float, check: Callable[[], None]
) -> Connection:
    """multiprocessing's `Client(address, authkey)` with a deadline, calling `check` while it waits. Client itself
    waits forever when something accepts the connection and never speaks (another program on the port; rank 0's
    Listener sends its challenge as soon as it accepts)."""
    sock = socket.create_connection(address, timeout=max(_POLL_S, deadline - time.monotonic()))
    with sock:
        while not select.select([sock], [], [], _POLL_S)[0]:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError
        sock.setblocking(True)
        conn = Connection(sock.detach())
    try:
        answer_challenge(conn, authkey)  # what Client does once connected
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


def _launch(
    ranks: int,
    address: tuple[str, int],
    authkey: bytes,
    log_dir: Path,
    config: TrainerConfig,
    gpus: Sequence[int] = (),
) -> list[subprocess.Popen]:
    """`ranks` processes of fsdp_rank.py with torchrun's environment, each logging to log_dir/rank{N}.log, on the
    GPUs at positions `gpus` of this process's (the placement's train_gpus; none on a CPU)."""
    shared = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": str(max(1, cpu_threads() // ranks)),
        "PYTHONUNBUFFERED": "1",
        "ARTNB_FSDP_DEVICE": config.device,
        CONTROL_ENV: f"{address[0]}:{address[1]}",
        AUTHKEY_ENV: authkey.hex(),
    }
    processes = []
    for rank in range(ranks):
        env = rank_environment(rank, ranks, gpus=gpus, parent=os.environ, extra=shared)
        with open(log_dir / f"rank{rank}.log", "ab") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "artnb.backends.trainers.fsdp_rank"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    return processes


def rank_environment(
    rank: int, ranks: int, *, gpus: Sequence[int], parent: Mapping[str, str], extra: Mapping[str, str]
) -> dict[str, str]:
    """Local rank `rank` of `ranks`: `parent`'s environment with torchrun's variables and `extra`. With `gpus`
    (positions among the parent's GPUs) CUDA_VISIBLE_DEVICES lists only those, so LOCAL_RANK r is the r-th of
    them (fsdp_rank.py sets device r); without, the GPUs the parent sees are left as they are.

    >>> env = rank_environment(1, 2, gpus=(2, 3), parent={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, extra={})
    >>> env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]
    ('1', '6,7')
    """
    if gpus and ranks > len(gpus):
        raise ValueError(
            f"ranks={ranks}: the placement gives the FSDP trainer {len(gpus)} GPUs ({list(gpus)}), one per rank; "
            f"pass ranks={len(gpus)} or fewer (ranks=None takes one per GPU)"
        )
    env = {
        **parent,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        **extra,
    }
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, parent.get("CUDA_VISIBLE_DEVICES"))
    return env


def _stop(processes: list[subprocess.Popen], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s  # a rank told to stop leaves the group cleanly first
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for p in processes:
        if p.poll() is None:
            p.terminate()
    for p in processes:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-_LOG_TAIL_LINES:])
