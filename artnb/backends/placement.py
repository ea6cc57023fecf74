"""Which GPUs serve (vLLM's tensor and data parallel sizes) and which train (FSDP ranks), from a GPU count and
a model size: one pure function, so every machine's answer can be checked on a CPU.

Rules, and why:
- vLLM's tensor parallel size is the smallest power of two whose GPUs hold the weights in half their memory (the
  other half is the KV cache); the rest of the serving GPUs replicate that (data parallel size).
- Colocated by default: every GPU serves, then every GPU trains while vLLM sleeps (as on one GPU), so neither
  phase leaves GPUs idle. `split=True` gives the first half of the GPUs to vLLM and the other half to the trainer,
  which keeps the engine awake across steps (no sleep and wake) at the price of half the GPUs per phase
  (`TrainerConfig(placement="split")`).
- GPU indices here are positions among the GPUs this process sees; `visible_devices` turns them into the
  CUDA_VISIBLE_DEVICES that confines a child process (vLLM, a trainer rank) to its role's GPUs.
- The trainer's shard of the weights (FSDP2 over its GPUs) needs no check of its own: the trainer has at least
  as many GPUs as one vLLM replica, so its shard is no larger than vLLM's, and the other half of each GPU holds
  the gathered layer, the activations and the LoRA's gradients and AdamW state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SERVE_SHARE = 0.5  # of a GPU's memory for vLLM's share of the weights; the rest for its KV cache
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

    @property
    def colocated(self) -> bool:
        return self.serve_gpus == self.train_gpus

    def vllm_args(self) -> list[str]:
        """vLLM's flags for this placement (engine_options' extra_args). Split: no sleep mode, since the trainer
        does not use vLLM's GPUs (VLLMEngine.hold then only holds requests; it does not sleep)."""
        return [
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--data-parallel-size",
            str(self.data_parallel_size),
            *([] if self.colocated else ["--no-enable-sleep-mode"]),
        ]

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
        if not self.serve_gpus:
            return "placement: no GPU; the engine and 2 gloo trainer ranks share the CPU"
        how = (
            "colocated (vLLM sleeps while the trainer steps)"
            if self.colocated
            else "split (vLLM stays awake while the trainer steps)"
        )
        return (
            f"placement: {how}; vLLM on GPUs {list(self.serve_gpus)} (tensor parallel "
            f"{self.tensor_parallel_size} x data parallel {self.data_parallel_size}), FSDP trainer on GPUs "
            f"{list(self.train_gpus)} ({len(self.train_gpus)} ranks)"
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
    tensor_parallel = 1
    while model_bytes > tensor_parallel * gpu_bytes * SERVE_SHARE:
        tensor_parallel *= 2
        if tensor_parallel > len(serve):
            raise ValueError(
                f"the model's {model_bytes / 2**30:.1f} GiB of weights do not fit half the memory of the "
                f"{len(serve)} serving GPUs ({gpu_bytes / 2**30:.0f} GiB each): use more GPUs or nodes"
                + (", or split=False (TrainerConfig(placement='colocated'))" if split else "")
            )
    return Placement(serve, train, tensor_parallel, len(serve) // tensor_parallel)


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
