"""Which GPUs serve (vLLM's tensor and data parallel sizes) and which train (FSDP ranks), from a GPU count and
a model size: one pure function, so every machine's answer can be checked on a CPU.

Rules, and why:
- vLLM's tensor parallel size is the smallest power of two whose GPUs hold the weights in half their memory (the
  other half is the KV cache); the rest of the serving GPUs replicate that (data parallel size).
- Colocated by default: every GPU serves, then every GPU trains while vLLM sleeps (as on one GPU), so neither
  phase leaves GPUs idle. `split=True` gives the first half of the GPUs to vLLM and the other half to the trainer,
  which keeps the engine awake across steps (no sleep and wake) at the price of half the GPUs per phase
  (`TrainerConfig(placement="split")`).
- ART's dedicated mode (`_internal_config` `trainer_gpu_ids` and `inference_gpu_ids`) names the GPUs of each role
  itself (`dedicated_placement`): vLLM's sizes are chosen on its GPUs as above. ART trains in its own process and so
  requires the trainer's GPUs to start at GPU 0; here that holds for the PEFT and Unsloth trainers (which train in
  this process, on its GPU 0), and the FSDP trainer's ranks take any GPUs.
- A split placement gives vLLM `--gpu-memory-utilization 0.9` (vLLM's own default) instead of the colocated 0.7:
  nothing else uses its GPUs.
- GPU indices here are positions among the GPUs this process sees; `visible_devices` turns them into the
  CUDA_VISIBLE_DEVICES that confines a child process (vLLM, a trainer rank) to its role's GPUs.
- The trainer's shard of the weights (FSDP2 over its GPUs) needs no check of its own: the trainer has at least
  as many GPUs as one vLLM replica, so its shard is no larger than vLLM's, and the other half of each GPU holds
  the gathered layer, the activations and the LoRA's gradients and AdamW state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SERVE_SHARE = 0.5  # of a GPU's memory for vLLM's share of the weights; the rest for its KV cache
SPLIT_MEMORY_SHARE = 0.9  # vLLM's --gpu-memory-utilization on GPUs it does not share with the trainer
# How the FSDP trainer's rank 0 and the process driving it find each other (here, not in trainers/, so that
# skypilot.py can write them into a node's run script without importing torch).
FSDP_CONTROL_ENV = "ARTNB_FSDP_CONTROL"  # host:port rank 0 listens on for the FsdpTrainer
FSDP_AUTHKEY_ENV = "ARTNB_FSDP_AUTHKEY"  # hex; the FsdpTrainer must present it


@dataclass(frozen=True)
class Placement:
    """GPU indices per role and vLLM's parallel sizes; `str()` is the line printed at register."""

    serve_gpus: tuple[int, ...]
    train_gpus: tuple[int, ...]
    tensor_parallel_size: int
    data_parallel_size: int
    in_process: bool = False  # the trainer runs in this process (PEFT, Unsloth), not as FSDP ranks
    attached: str | None = None  # host:port of rank 0 when torchrun started the FSDP ranks (a cluster)

    @property
    def colocated(self) -> bool:
        return self.serve_gpus == self.train_gpus

    def vllm_args(self) -> list[str]:
        """vLLM's flags for this placement (engine_options' extra_args). Split: no sleep mode, since the trainer
        does not use vLLM's GPUs (VLLMEngine.hold then only holds requests; it does not sleep), and vLLM's own
        default memory share instead of the one that leaves room for a trainer."""
        args = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        args += ["--data-parallel-size", str(self.data_parallel_size)]
        if not self.colocated:
            args += ["--no-enable-sleep-mode", "--gpu-memory-utilization", str(SPLIT_MEMORY_SHARE)]
        return args

    def vllm_env(self, parent: str | None) -> dict[str, str]:
        """Split: CUDA_VISIBLE_DEVICES for vLLM's process, the serving GPUs (`parent`: this process's
        CUDA_VISIBLE_DEVICES, see `visible_devices`); colocated: nothing, vLLM sees every GPU.

        >>> Placement((0, 1), (2, 3), 1, 2).vllm_env("4,5,6,7")
        {'CUDA_VISIBLE_DEVICES': '4,5'}
        """
        if self.colocated or not self.serve_gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": visible_devices(self.serve_gpus, parent)}

    def __str__(self) -> str:
        if not self.serve_gpus and self.attached:
            return f"placement: no GPU; the engine and the gloo ranks torchrun started (rank 0 at {self.attached})"
        if not self.serve_gpus:
            return "placement: no GPU; the engine and 2 gloo trainer ranks share the CPU"
        how = (
            "colocated (vLLM sleeps while the trainer steps)"
            if self.colocated
            else "split (vLLM stays awake while the trainer steps)"
        )
        if self.in_process:
            trainer = "the trainer on GPU 0 (in this process)"
        elif self.attached:
            trainer = f"FSDP trainer on the ranks torchrun started, every GPU of each node (rank 0 at {self.attached})"
        else:
            trainer = f"FSDP trainer on GPUs {list(self.train_gpus)} ({len(self.train_gpus)} ranks)"
        return (
            f"placement: {how}; vLLM on GPUs {list(self.serve_gpus)} (tensor parallel "
            f"{self.tensor_parallel_size} x data parallel {self.data_parallel_size}), {trainer}"
        )


def plan_placement(num_gpus: int, model_bytes: int, gpu_bytes: int, *, split: bool = False) -> Placement:
    """Place vLLM and the FSDP trainer on `num_gpus` GPUs of `gpu_bytes` each for a model of `model_bytes`.

    >>> str(plan_placement(8, 140 * 2**30, 80 * 2**30))  # a 70B model in bf16 on 8 H100s
    'placement: colocated (vLLM sleeps while the trainer steps); vLLM on GPUs [0, 1, 2, 3, 4, 5, 6, 7] (tensor parallel 4 x data parallel 2), FSDP trainer on GPUs [0, 1, 2, 3, 4, 5, 6, 7] (8 ranks)'
    """
    if num_gpus < 0 or model_bytes < 0 or gpu_bytes <= 0:
        raise ValueError(
            f"num_gpus={num_gpus}, model_bytes={model_bytes}, gpu_bytes={gpu_bytes}: need >= 0, > 0"
        )
    if num_gpus == 0:
        return Placement((), (), 1, 1)
    gpus = tuple(range(num_gpus))
    serve, train = (gpus[: num_gpus // 2], gpus[num_gpus // 2 :]) if split else (gpus, gpus)
    if not serve:
        raise ValueError(
            f"split=True (TrainerConfig(placement='split')) needs at least 2 GPUs, one to serve and one to "
            f"train, and this machine has {num_gpus}: use placement='colocated'"
        )
    fix = "use more GPUs or nodes" + (
        ", or split=False (TrainerConfig(placement='colocated'))" if split else ""
    )
    tensor_parallel = _tensor_parallel(len(serve), model_bytes, gpu_bytes, fix)
    return Placement(serve, train, tensor_parallel, len(serve) // tensor_parallel)


def dedicated_placement(
    train_gpus: Sequence[int],
    serve_gpus: Sequence[int],
    num_gpus: int,
    model_bytes: int,
    gpu_bytes: int,
    *,
    in_process: bool,
    engine_parallel: tuple[int, int] | None = None,
) -> Placement:
    """ART's dedicated mode on this process's `num_gpus` GPUs: the trainer on `train_gpus`, vLLM on `serve_gpus`
    (as `dev.settings` checked them). `in_process`: the PEFT or Unsloth trainer, which trains on this process's
    GPU 0, so `train_gpus` must start with 0. `engine_parallel`: the (tensor, pipeline) parallel sizes the model's
    engine_args ask for, which must divide the serving GPUs (the rest is data parallel); else sized as in
    plan_placement.

    >>> str(dedicated_placement([0], [1, 2, 3], 4, 15 * 2**30, 80 * 2**30, in_process=True))
    'placement: split (vLLM stays awake while the trainer steps); vLLM on GPUs [1, 2, 3] (tensor parallel 1 x data parallel 3), the trainer on GPU 0 (in this process)'
    """
    train, serve = tuple(train_gpus), tuple(serve_gpus)
    out_of_range = sorted(g for g in train + serve if g >= num_gpus)
    if out_of_range:
        raise ValueError(
            f"_internal_config trainer_gpu_ids={list(train)}, inference_gpu_ids={list(serve)}: GPU "
            f"{out_of_range[0]} is not one of this process's {num_gpus} GPUs (numbered 0-{num_gpus - 1}, after "
            "CUDA_VISIBLE_DEVICES): use ids below that"
        )
    if in_process and train[0] != 0:
        raise ValueError(
            f"_internal_config trainer_gpu_ids={list(train)}: the PEFT and Unsloth trainers train in this process, "
            "on its GPU 0, so trainer_gpu_ids must start with 0 (e.g. trainer_gpu_ids=[0], inference_gpu_ids=[1]); "
            "or use LocalBackend(trainer='fsdp'), whose ranks train on any GPUs"
        )
    if engine_parallel is None:
        fix = "give vLLM more inference_gpu_ids"
        tensor_parallel = _tensor_parallel(len(serve), model_bytes, gpu_bytes, fix)
        return Placement(serve, train, tensor_parallel, len(serve) // tensor_parallel, in_process)
    tensor_parallel, pipeline_parallel = engine_parallel
    if len(serve) % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"_internal_config engine_args ask for tensor_parallel_size={tensor_parallel} x "
            f"pipeline_parallel_size={pipeline_parallel} GPUs per vLLM replica, which does not divide the "
            f"{len(serve)} inference_gpu_ids {list(serve)}: give a multiple of {tensor_parallel * pipeline_parallel} "
            "inference GPUs, or leave the sizes out and artnb sizes them from the model"
        )
    replicas = len(serve) // (tensor_parallel * pipeline_parallel)
    return Placement(serve, train, tensor_parallel, replicas, in_process)


def _tensor_parallel(serving: int, model_bytes: int, gpu_bytes: int, fix: str) -> int:
    """The smallest power of two of the `serving` GPUs that holds the weights in SERVE_SHARE of their memory."""
    tensor_parallel = 1
    while model_bytes > tensor_parallel * gpu_bytes * SERVE_SHARE:
        tensor_parallel *= 2
        if tensor_parallel > serving:
            raise ValueError(
                f"the model's {model_bytes / 2**30:.1f} GiB of weights do not fit half the memory of the "
                f"{serving} serving GPUs ({gpu_bytes / 2**30:.0f} GiB each): {fix}"
            )
    return tensor_parallel


def visible_devices(gpus: Sequence[int], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that is to see only the GPUs at positions `gpus` among this
    process's GPUs. `parent` is this process's CUDA_VISIBLE_DEVICES: the positions index its entries (ids, UUIDs
    or MIG names alike); None (unset) means every GPU, numbered from 0.

    >>> visible_devices((2, 3), "4,5,6,7")  # the child's GPU 0 is this process's GPU 2, physical GPU 6
    '6,7'
    >>> visible_devices((0, 1), None)
    '0,1'
    """
    if parent is None:
        return ",".join(str(gpu) for gpu in gpus)
    entries = [entry.strip() for entry in parent.split(",")] if parent.strip() else []
    for gpu in gpus:
        if not 0 <= gpu < len(entries) or not entries[gpu]:
            raise ValueError(
                f"GPU {gpu}: this process sees {len(entries)} GPUs (CUDA_VISIBLE_DEVICES={parent!r}), numbered from 0"
            )
    return ",".join(entries[gpu] for gpu in gpus)


def weight_bytes(model_path: str | Path) -> int:
    """The size of a model directory's weights (its safetensors files), what placing it goes by."""
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))


def local_gpus(device: str = "auto") -> tuple[int, int]:
    """(count, bytes each) of the CUDA GPUs this process sees, the first one's size for all; (0, 1) without CUDA
    or with `device="cpu"`. torch is imported here only, so that this module stays importable without it."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return 0, 1
    return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
