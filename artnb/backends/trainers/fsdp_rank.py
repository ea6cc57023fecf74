"""One rank of the FSDP trainer: the PeftTrainer's step, with the base model and the LoRA sharded by FSDP2.

Run as `python -m artnb.backends.trainers.fsdp_rank` with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): FsdpTrainer (fsdp_trainer.py) starts the ranks of one machine itself with exactly
that environment, and `torchrun` starts them across nodes (skypilot.py). Design choices:
- `RankTrainer` is a PeftTrainer: the micro-batching, logprobs, `grpo.policy_loss`, SFT loss, clipping and AdamW
  are its code, unchanged. It overrides only what sharding changes: where the model lives (`fully_shard` on each
  decoder layer, then the whole PeftModel), which sequences this rank runs (`_local_batches`) and how the
  ranks' loss and metric sums add up (`_all_ranks`).
- Each rank computes its share's loss divided by the *whole* batch's trainable-token count, and FSDP's
  reduce-scatter *sums* the ranks' gradients (divide factor 1): the sharded gradient is the full-batch one, as in
  one process. Sequences are never split across ranks (GSPO's ratio is per sequence); they are dealt out
  longest first to the rank with the fewest tokens so far.
- Every rank runs the same number of forward/backward passes (FSDP gathers each layer's weights in each pass):
  a rank with fewer micro-batches runs idle ones, a real sequence with nothing trainable, whose gradient is zero.
- Loading: rank 0 reads the weights (and draws the LoRA's initial values, as the PeftTrainer does); the other
  ranks build the model on the meta device, and once sharded each receives its shards from rank 0
  (`set_model_state_dict` with `broadcast_from_rank0`, one tensor at a time). Only rank 0 ever holds the whole
  model, and only rank 0 reads the files.
- FSDP's root unit is `_Root`, around the PeftModel, and every pass runs inside its forward: chunked logprobs
  call the decoder and the LM head apart (outside the PeftModel's forward), and find the embeddings and the head
  gathered. Shared-prefix passes stay off: a prefix pass runs each layer twice, and every rank must run the same
  passes (FSDP gathers each layer's weights in each pass).
- Control: rank 0 listens on ARTNB_FSDP_CONTROL for the one FsdpTrainer that drives the ranks, and broadcasts
  each command to the other ranks over a gloo group with a long timeout (a notebook may wait an hour between
  steps; the compute group keeps torch's default timeout). Any exception on any rank ends that rank's process:
  the notebook sees the process go and says which rank died, with its log. The one exception is a checkpoint
  that does not fit, which every rank finds alike after rank 0 broadcast it: that is returned as the error.
- Checkpoints are the PeftTrainer's files: the ranks gather each LoRA tensor and AdamW moment (`full_tensor`),
  rank 0 writes them with PEFT's `save_pretrained` and `torch.save`, then all ranks meet at a barrier. Loading,
  rank 0 reads the files and broadcasts them; each rank keeps its slice. So a run moves between 1 and N ranks.

FSDP2 on the CPU, as found in torch 2.13 with 2 gloo ranks: `fully_shard` works (gloo has the all-gather and
reduce-scatter FSDP2 uses), but a custom gradient divide factor makes FSDP2 reduce with ReduceOp.PREMUL_SUM,
which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). FSDP2's documented switch
`set_force_sum_reduction_for_comms(True)` makes it use plain SUM with the scaling done apart (a factor of 1
here), so the CPU tests run the code GPUs run.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]  # documented API, re-exported from torch._C
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import PreTrainedModel

from ...core.config import LoRAConfig, TrainerConfig
from ...core.tokenize import TokenizedSequence
from ..placement import FSDP_AUTHKEY_ENV as AUTHKEY_ENV
from ..placement import FSDP_CONTROL_ENV as CONTROL_ENV
from .peft_trainer import ADAPTER_WEIGHTS, OPTIMIZER_STATE, LossSums, MicroBatch, PeftTrainer

_ADAPTER = ".default"  # PEFT's adapter name inside parameter names, absent from saved adapter files
_SUM_FIELDS = (
    "loss",
    "policy_loss",
    "kl",
    "clip_fraction",
    "ratio_mean",
    "ratio_square_mean",
    "mismatch_sum",
    "mismatch_count",
    "micro_batches",
    "tokens",
)


class CheckpointRefused(Exception):
    """A checkpoint every rank found unfit alike (after rank 0 broadcast it): an answer, not a crash."""


class _Root(torch.nn.Module):
    """FSDP's root unit, around the PeftModel: the root's parameters (embeddings, final norm, LM head) are
    gathered for a whole `forward(run)`, which calls `run()`. PeftTrainer's chunked logprobs call the decoder and
    the head apart, outside the PeftModel's own forward; with the PeftModel as the root unit they would find
    those parameters still sharded."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Callable[[], Any]) -> Any:
        return run()


class RankTrainer(PeftTrainer):
    """The PeftTrainer on one rank of an FSDP2 group (see the module docstring)."""

    def __init__(self, base_model_path: str, lora: LoRAConfig, config: TrainerConfig) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._in_root = False
        super().__init__(base_model_path, lora, config)

    def _base_weights(self, base_model_path: str, dtype: torch.dtype) -> PreTrainedModel:
        """Rank 0 reads the weights onto the CPU; the others build the model on the meta device (no memory) and
        receive their shards from rank 0 once sharded (`_load_model`): only rank 0 ever holds the whole model."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.rank == 0:
            return AutoModelForCausalLM.from_pretrained(base_model_path, dtype=dtype)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_model_path), dtype=dtype)

    def _load_model(self, base_model_path: str, lora: LoRAConfig, config: TrainerConfig):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # Rank 0: the weights and a fresh LoRA, on the CPU. The others: the same modules on the meta device.
        model = super()._load_model(base_model_path, lora, config)
        whole = model.state_dict() if self.rank == 0 else {}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for module in model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module, mesh=mesh)
        self._root = _Root(model)
        fully_shard(self._root, mesh=mesh)
        for module in self._root.modules():
            if isinstance(module, FSDPModule):
                # Sum the ranks' gradients (each is a share of the batch); plain SUM, as gloo has no PREMUL_SUM.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        if self.rank != 0:
            model.to_empty(device=self.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, whole, options=options)
        for buffer in model.buffers():  # rotary frequencies and the like: not in the state dict, not sharded
            dist.broadcast(buffer, src=0)
        del whole
        return model

    def _shares_prefixes(self) -> bool:
        return False  # a prefix pass runs each layer twice: every rank must run the same passes

    def _logprobs(self, batch: MicroBatch, adapter: bool = True, chunk_size: int | None = None) -> Tensor:
        """PeftTrainer's, inside the root unit's forward (see `_Root`)."""
        if self._in_root:
            return super()._logprobs(batch, adapter, chunk_size)
        if chunk_size is not None and self._chunkable is None:
            # Whether chunking is exact is found by a forward pass, which every rank must make at once: here, at
            # the first chunked pass, which all ranks reach together (the same passes in the same order). Not
            # inside PeftTrainer._logprobs, where it depends on this rank's micro-batch size.
            self._can_chunk_logprobs()
        self._in_root = True
        try:
            return self._root(lambda: PeftTrainer._logprobs(self, batch, adapter, chunk_size))
        finally:
            self._in_root = False

    def _logits_are_head_of_decoder(self) -> bool:
        return self._root(lambda: PeftTrainer._logits_are_head_of_decoder(self))

    def _local_batches(self, trainable: list[TokenizedSequence], budget: int) -> list[MicroBatch]:
        mine = [trainable[i] for i in deal(trainable, self.world_size)[self.rank]]
        batches = self._micro_batches(mine, budget) if mine else []
        count = torch.tensor(len(batches))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=_control)
        while len(batches) < int(count):
            batches.append(self._idle_batch(min(trainable, key=lambda s: len(s.token_ids))))
        return batches

    def _idle_batch(self, sequence: TokenizedSequence) -> MicroBatch:
        """A pass that runs `sequence` and trains nothing: FSDP's collectives need every rank in each pass."""
        batch = self._collate([sequence])
        batch.mask = torch.zeros_like(batch.mask)
        batch.num_tokens = 0
        return batch

    def _all_ranks(self, sums: LossSums) -> LossSums:
        values = torch.tensor([float(getattr(sums, f)) for f in _SUM_FIELDS], dtype=torch.float64)
        dist.all_reduce(values, group=_control)
        total = LossSums(sums.denominator)
        for name, value in zip(_SUM_FIELDS, values.tolist(), strict=True):
            setattr(total, name, type(getattr(sums, name))(value))
        return total

    # ----- checkpoints: the PeftTrainer's files, gathered on rank 0 ---------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        lora = {name: _full(p) for name, p in self._trainable()}
        saved = self.optimizer.state_dict()
        state = {
            index: {key: _full(value) for key, value in sorted(entry.items())}
            for index, entry in sorted(saved["state"].items())
        }
        if self.rank == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(str(path), state_dict=lora)
            torch.save({"state": state, "param_groups": saved["param_groups"]}, path / OPTIMIZER_STATE)
        dist.barrier(group=_control)

    def load_checkpoint(self, path: str | Path) -> None:
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = self._read_checkpoint(Path(path))
            except (FileNotFoundError, ValueError) as error:
                payload[0] = error
        dist.broadcast_object_list(payload, src=0, group=_control)
        if isinstance(payload[0], Exception):
            raise CheckpointRefused() from payload[0]
        weights, optimizer = payload[0]
        ours = {name.replace(_ADAPTER, ""): p for name, p in self._trainable()}
        if ours.keys() != weights.keys():
            missing, unexpected = sorted(ours.keys() - weights.keys()), sorted(weights.keys() - ours.keys())
            raise CheckpointRefused() from ValueError(
                f"adapter in {path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for key, param in ours.items():
                shard = cast(DTensor, param).to_local()  # fully_shard made every parameter a DTensor
                shard.copy_(_my_slice(weights[key].to(param.dtype), param).to_local())
        self.optimizer = self._new_optimizer()
        if optimizer is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            state = {
                index: {key: _my_slice(value, params[index]) for key, value in entry.items()}
                for index, entry in optimizer["state"].items()
            }
            self.optimizer.load_state_dict({"state": state, "param_groups": optimizer["param_groups"]})

    def _read_checkpoint(self, path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
        """What PeftTrainer.load_checkpoint reads and checks, on the CPU, for rank 0 to broadcast."""
        import json

        from peft.utils import load_peft_weights

        if (
            not any((path / n).is_file() for n in ADAPTER_WEIGHTS)
            or not (path / "adapter_config.json").is_file()
        ):
            raise FileNotFoundError(
                f"{path} has no {ADAPTER_WEIGHTS[0]} + adapter_config.json: pass a directory written by "
                "save_checkpoint (or PEFT's save_pretrained)"
            )
        self._check_adapter_config(json.loads((path / "adapter_config.json").read_text()), path)
        weights = load_peft_weights(str(path), device="cpu")
        optimizer = None
        if (path / OPTIMIZER_STATE).is_file():
            optimizer = torch.load(path / OPTIMIZER_STATE, map_location="cpu", weights_only=True)
        return weights, optimizer

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]


def deal(sequences: list[TokenizedSequence], ranks: int) -> list[list[int]]:
    """Indices of `sequences` per rank: longest first, each to the rank with the fewest tokens so far (ties to
    the lower rank). Every rank computes the same answer from the same list.

    >>> seqs = [TokenizedSequence([0] * n, [True] * n, [0.0] * n, 0.0, 0, 0) for n in (5, 9, 3, 4)]
    >>> deal(seqs, 2)
    [[1, 2], [0, 3]]
    """
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i].token_ids))
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in order:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shares[rank].append(i)
        load[rank] += len(sequences[i].token_ids)
    return shares


def _full(value: Any) -> Any:
    """A DTensor gathered whole onto the CPU (a collective: every rank calls it in the same order)."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _my_slice(value: Any, param: torch.Tensor) -> Any:
    """This rank's shard of a full tensor shaped like `param` (a DTensor), cut here without communication."""
    if isinstance(value, torch.Tensor) and isinstance(param, DTensor) and value.shape == param.shape:
        return distribute_tensor(
            value.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None
        )
    return value


# ----- the rank's main loop -------------------------------------------------------------------------------

_control: Any = None  # the gloo group commands and metric sums travel on


def _serve_commands(conn: Connection | None) -> None:
    """Receive each command (rank 0 from the FsdpTrainer, the others by broadcast), run it, answer (rank 0)."""
    trainer: RankTrainer | None = None
    while True:
        message: list[Any] = [conn.recv() if conn is not None else None]
        dist.broadcast_object_list(message, src=0, group=_control)
        command, args, kwargs = message[0]
        if command == "stop":
            return
        try:
            if command == "init":
                trainer = RankTrainer(*args)
                result: Any = {"max_seq_length": trainer.max_seq_length, "world_size": trainer.world_size}
            else:
                result = getattr(trainer, command)(*args, **kwargs)
            reply = ("ok", result)
        except CheckpointRefused as refused:
            reply = ("error", refused.__cause__)
        if conn is not None:
            conn.send(reply)


def main() -> None:
    """Join the process group from torchrun's environment, then serve commands until told to stop."""
    global _control
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_cuda = torch.cuda.is_available() and os.environ.get("ARTNB_FSDP_DEVICE", "auto") != "cpu"
    if on_cuda:
        torch.cuda.set_device(local_rank)
    backend = "nccl" if on_cuda else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart is not None:
        # torchrun's static rendezvous (--master-addr, as the SkyPilot script starts it) keeps one store across
        # the group's restarts, unprefixed: a restarted rank could read the dead ranks' addresses from it and
        # fail to connect. Each attempt gets keys of its own.
        agent_store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, wait_for_workers=False
        )
        store = PrefixStore(f"artnb/attempt_{restart}", agent_store)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend)
    _control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    rank = dist.get_rank()
    print(f"artnb fsdp rank {rank}/{dist.get_world_size()} up (pid {os.getpid()})", flush=True)
    conn = None
    if rank == 0:
        host, port = os.environ[CONTROL_ENV].rsplit(":", 1)
        with Listener((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV])) as listener:
            conn = listener.accept()
    code = 0
    try:
        _serve_commands(conn)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No destroy_process_group: after a failure the other ranks may be stuck in a collective with this one, and
    # after "stop" every rank leaves at once (tearing gloo down waited seconds for the peers).
    os._exit(code)


if __name__ == "__main__":
    main()
