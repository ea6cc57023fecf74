"""PeftTrainer: one GRPO optimizer step per call on a LoRA adapter, with transformers + PEFT + plain torch.

Design choices, and why:
- One `train` call = one AdamW step over the whole batch (on-policy GRPO: one update per rollout batch). The
  batch is cut into micro-batches under a padded-token budget; each micro-batch's loss is divided by the
  trainable-token count of the *whole* batch, so the accumulated gradient equals the full-batch gradient.
- Logits are computed only at positions whose next token is trainable (`logits_to_keep` with the positions the
  micro-batch needs), then log_softmax + gather. On the embedded 135M model with half the tokens trainable this
  is ~2x faster than full logits, and log_softmax + gather beat `cross_entropy(reduction="none")` on this CPU.
- `logprob_calculation_chunk_size` (ART's knob): the decoder's hidden states go through the LM head and
  log_softmax that many positions at a time, each chunk checkpointed (recomputed in backward), so at most one
  chunk of [positions, vocab] logits is alive. Models whose logits are more than the output embedding of the
  decoder's hidden states (soft-capping, logit scaling) are found by one check on a few tokens and keep the
  one-shot path.
- `precalculate_logprobs`: the old logprobs come from a no-grad, eval-mode pass of the trainer itself before the
  update; the engine's are kept for the mismatch metric and truncated importance sampling.
- fp32 on the CPU (bf16 backward is ~35x slower there), bf16 weights on CUDA with fp32 LoRA weights and loss.
- AdamW betas (0.9, 0.99) as ART uses for RL: the second moment adapts within ~100 steps. The optimizer lives as
  long as the trainer, so its state carries over between steps and into `optimizer.pt` checkpoints.
- Reference logprobs for the KL term come from the same model with the adapter switched off (no second copy).
- Nothing here knows about trajectories or asyncio: the backend calls `train` from a worker thread.
"""

from __future__ import annotations

import inspect
import json
import math
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.utils.checkpoint
from torch import Tensor

from ...core import grpo
from ...core.config import LoRAConfig, TrainConfig, TrainerConfig
from ...core.ignored import report_ignored
from ...core.tokenize import TokenizedSequence
from ...models import MODEL_BUILD_LOCK
from ..cpu_threads import cpu_threads

if TYPE_CHECKING:  # imported where used: `import artnb` loads neither
    from peft import LoraConfig
    from transformers import PreTrainedModel

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_MIN_SHARED_PREFIX = 16  # below this, a separate pass over the prefix costs more than it saves
_PASS_COST = 16  # what one more forward/backward pass costs, in tokens, beyond its own
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.pt"


@dataclass
class MicroBatch:
    """Right-padded inputs plus per-position training tensors at the kept positions only."""

    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    keep: Tensor  # [K] positions p whose logits predict token p + 1
    targets: Tensor  # [B, K] token p + 1
    mask: Tensor  # [B, K] True where token p + 1 is trainable
    old_logprobs: Tensor  # [B, K] engine logprob of token p + 1 (NaN where unknown)
    advantages: Tensor  # [B, K]
    num_tokens: int  # real (unpadded) tokens, prompt included
    sampled_logprobs: Tensor | None = None  # [B, K] the engine's, once old_logprobs are the trainer's own
    prefix_len: int = 0  # leading tokens all rows share (none trainable): computed once, not once per row


@dataclass
class LossSums:
    """Loss and metric sums over a step's micro-batches, each weighted by its share of trainable tokens."""

    denominator: int  # trainable tokens in the whole batch
    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ratio_mean: float = 0.0
    ratio_square_mean: float = 0.0
    mismatch_sum: float = 0.0
    mismatch_count: int = 0
    micro_batches: int = 0  # run with trainable tokens (an FSDP rank's idle passes do not count)
    tokens: int = 0  # real tokens run, prompts included

    def count(self, batch: MicroBatch, loss: float) -> None:
        self.loss += loss
        if batch.num_tokens:
            self.micro_batches += 1
            self.tokens += batch.num_tokens

    def add(self, batch: MicroBatch, new: Tensor, loss: float, metrics: dict[str, float]) -> None:
        share = int(batch.mask.sum()) / self.denominator
        self.count(batch, loss)
        self.policy_loss += metrics["policy_loss"]
        self.kl += metrics.get("kl", 0.0) * share
        self.clip_fraction += metrics.get("clip_fraction", 0.0) * share
        self.ratio_mean += metrics.get("ratio_mean", 0.0) * share
        self.ratio_square_mean += metrics.get("ratio_square_mean", 0.0) * share
        sampled = batch.old_logprobs if batch.sampled_logprobs is None else batch.sampled_logprobs
        known = batch.mask & ~torch.isnan(sampled)
        self.mismatch_sum += (new - sampled)[known].abs().sum().item()
        self.mismatch_count += int(known.sum())

    def metrics(
        self,
        *,
        grad_norm: float,
        num_sequences: int,
        seconds: float,
        learning_rate: float,
        config: TrainConfig,
    ) -> dict[str, float]:
        result = {
            "loss": self.loss,
            "policy_loss": self.policy_loss,
            "grad_norm": grad_norm,
            "clip_fraction": self.clip_fraction,
            "ratio_mean": self.ratio_mean,
            "ratio_std": math.sqrt(max(self.ratio_square_mean - self.ratio_mean**2, 0.0)),
            "num_trainable_tokens": float(self.denominator),
            "num_sequences": float(num_sequences),
            "num_micro_batches": float(self.micro_batches),
            "tokens_per_second": self.tokens / seconds,
            "seconds": seconds,
            "learning_rate": learning_rate,
        }
        if config.kl_penalty_coef > 0:
            result["kl"] = self.kl
        if self.mismatch_count:
            result["logprob_mismatch"] = self.mismatch_sum / self.mismatch_count
        return result


class PeftTrainer:
    """Trains a LoRA adapter on `TokenizedSequence`s with the GRPO loss of `artnb.core.grpo`.

    Example:
        >>> trainer = PeftTrainer(artnb.models.tiny(), LoRAConfig(r=4))  # doctest: +SKIP
        >>> metrics = trainer.train(sequences, TrainConfig(learning_rate=1e-3))  # doctest: +SKIP
        >>> trainer.save_checkpoint(tmp_dir)  # adapter_model.safetensors, adapter_config.json, optimizer.pt
    """

    def __init__(
        self, base_model_path: str, lora: LoRAConfig | None = None, config: TrainerConfig | None = None
    ) -> None:
        lora = lora or LoRAConfig()
        config = config or TrainerConfig()

        use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")
        if not use_cuda:
            torch.set_num_threads(cpu_threads())
        self.config = config
        with MODEL_BUILD_LOCK:  # another thread building a model meanwhile could leave this one empty
            self.model = self._load_model(str(base_model_path), lora, config)
        self.model.train()
        model = self._base_model()
        self._pad_id = _pad_token_id(model.config)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._chunkable: bool | None = None  # logits == head(decoder output)? checked at first chunked use
        self.optimizer = self._new_optimizer()
        self.last_timings: dict[str, float] = {}  # seconds per phase of the last train() (step_profile.py)

    def _load_model(self, base_model_path: str, lora: LoRAConfig, config: TrainerConfig):
        """The base model on `self.device` (bf16 on CUDA, fp32 on the CPU) with a fresh LoRA adapter (a PeftModel).
        UnslothTrainer loads it with Unsloth instead; everything else is shared."""
        from peft import LoraConfig, get_peft_model

        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = self._base_weights(base_model_path, dtype)
        targets = present_target_modules(model, lora.target_modules)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        torch.manual_seed(config.seed)
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, peft_config)

    def _base_weights(self, base_model_path: str, dtype: torch.dtype) -> PreTrainedModel:
        """The base model read from `base_model_path`, on this trainer's device (an FSDP rank's differ)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=dtype)
        return model.to(self.device)  # pyright: ignore[reportArgumentType]  # transformers wraps `to`: pyright binds no self

    def _base_model(self) -> PreTrainedModel:
        """The transformers model inside the PeftModel (peft types it as a plain torch Module)."""
        return cast("PreTrainedModel", self.model.get_base_model())

    @property
    def max_seq_length(self) -> int:
        """The base model's context length (`max_position_embeddings` or its equivalent)."""
        return context_length(self._base_model().config)

    # ----- checkpoints -------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the adapter (what an inference engine loads) and the AdamW state into the directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path))
        torch.save(self.optimizer.state_dict(), path / OPTIMIZER_STATE)

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from a directory written by `save_checkpoint`: adapter weights, and the AdamW state if present.

        Without `optimizer.pt` (an adapter from elsewhere) the optimizer starts afresh.
        """
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        path = Path(path)
        weights = next((path / n for n in ADAPTER_WEIGHTS if (path / n).is_file()), None)
        if weights is None or not (path / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(
                f"{path} has no {ADAPTER_WEIGHTS[0]} + {ADAPTER_CONFIG}: pass a directory written by "
                "save_checkpoint (or PEFT's save_pretrained)"
            )
        self._check_adapter_config(json.loads((path / ADAPTER_CONFIG).read_text()), path)
        state = load_peft_weights(str(path), device=str(self.device))
        result = set_peft_model_state_dict(self.model, state)
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"adapter in {path} does not fit this model: missing {missing[:3]}, unexpected "
                f"{list(result.unexpected_keys)[:3]}"
            )
        self.optimizer = self._new_optimizer()
        if (path / OPTIMIZER_STATE).is_file():
            self.optimizer.load_state_dict(
                torch.load(path / OPTIMIZER_STATE, map_location=self.device, weights_only=True)
            )

    # ----- training ----------------------------------------------------------------------------------------

    def train(
        self, sequences: list[TokenizedSequence], config: TrainConfig, *, progress: bool = True
    ) -> dict[str, float]:
        """One optimizer step of the GRPO loss over all `sequences`; returns metrics as plain floats.

        Phases: validate and collate the micro-batches, (if asked) recompute their old logprobs with this model,
        accumulate the gradient over them (forward, loss, backward), apply the update (clip, AdamW step). An
        exception before the update leaves the weights as they were; the backend reloads the last checkpoint
        after any failure anyway.
        """
        from tqdm.auto import tqdm

        started = time.perf_counter()
        timings = self.last_timings = {"prepare": 0.0, "precalculate": 0.0, "forward": 0.0, "backward": 0.0}
        batches, denominator = self._prepare(sequences, config)
        timings["prepare"] = time.perf_counter() - started
        if config.precalculate_logprobs:
            self._precalculate_old_logprobs(batches, config)
            timings["precalculate"] = time.perf_counter() - started - timings["prepare"]
        with tqdm(total=len(batches), desc="train", disable=not progress) as bar:
            sums = self._all_ranks(self._accumulate_gradients(batches, config, bar, denominator))
            update_started = time.perf_counter()
            grad_norm = self._apply_update(config)
            timings["optimizer"] = time.perf_counter() - update_started
            bar.set_postfix(loss=f"{sums.loss:.4f}", grad_norm=f"{grad_norm:.3g}")
        metrics = sums.metrics(
            grad_norm=grad_norm,
            num_sequences=len(sequences),
            seconds=time.perf_counter() - started,
            learning_rate=self.optimizer.param_groups[0]["lr"],
            config=config,
        )
        if config.verbose:
            print("artnb train: " + ", ".join(f"{name}={value:.4g}" for name, value in metrics.items()))
        return metrics

    def _prepare(
        self, sequences: list[TokenizedSequence], config: TrainConfig
    ) -> tuple[list[MicroBatch], int]:
        """Check the sequences, balance their advantages, cut them into micro-batches; set this step's learning
        rate: config.learning_rate * (trajectories trained on) ** num_trajectories_learning_rate_multiplier_power.
        Returns the micro-batches this process runs and the whole batch's trainable-token count."""
        trainable = grpo_sequences(sequences, config, self.max_seq_length)
        trajectories = len({(s.group_index, s.trajectory_index) for s in trainable})
        power = config.num_trajectories_learning_rate_multiplier_power
        for group in self.optimizer.param_groups:
            group["lr"] = config.learning_rate * trajectories**power
            group["weight_decay"] = config.weight_decay
        return self._local_batches(trainable, config.micro_batch_tokens), trainable_tokens(trainable)

    def _local_batches(self, trainable: list[TokenizedSequence], budget: int) -> list[MicroBatch]:
        """The micro-batches this process runs: all of them here; an FSDP rank (fsdp_rank.py) runs its share."""
        return self._micro_batches(trainable, budget)

    def _all_ranks(self, sums: LossSums) -> LossSums:
        """The step's sums over every process that trained a share of it: this one alone here (fsdp_rank.py
        adds the ranks' sums)."""
        return sums

    @torch.no_grad()
    def _precalculate_old_logprobs(self, batches: list[MicroBatch], config: TrainConfig) -> None:
        """ART's precalculate_logprobs: the old logprobs become this model's own (adapter on, eval mode, before
        the update); the engine's move to `sampled_logprobs`."""
        was_training = self.model.training
        self.model.eval()
        try:
            for batch in batches:
                own = self._logprobs(batch, chunk_size=config.logprob_calculation_chunk_size).float()
                batch.sampled_logprobs = batch.old_logprobs
                batch.old_logprobs = torch.where(batch.mask, own, torch.full_like(own, math.nan))
        finally:
            self.model.train(was_training)

    def _accumulate_gradients(
        self, batches: list[MicroBatch], config: TrainConfig, bar, denominator: int
    ) -> LossSums:
        """Forward, loss and backward per micro-batch; the gradients add up to the whole batch's
        (`denominator`: its trainable tokens)."""
        settings = config.loss_settings()
        sums = LossSums(denominator)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        chunk = config.logprob_calculation_chunk_size
        for batch in batches:
            ref = (
                self._logprobs(batch, adapter=False, chunk_size=chunk) if config.kl_penalty_coef > 0 else None
            )
            forward_started = time.perf_counter()
            new = self._logprobs(batch, chunk_size=chunk)
            loss, metrics = grpo.policy_loss(
                new,
                batch.old_logprobs,
                batch.advantages,
                batch.mask,
                settings,
                ref_logprobs=ref,
                sampling_logprobs=batch.sampled_logprobs,
                denominator=denominator,
            )
            backward_started = time.perf_counter()
            self.last_timings["forward"] += backward_started - forward_started
            loss.backward()
            self.last_timings["backward"] += time.perf_counter() - backward_started
            sums.add(batch, new.detach(), loss.item(), metrics)
            bar.set_postfix(loss=f"{sums.loss:.4f}")
            bar.update()
            del new, ref, loss
        return sums

    def _apply_update(self, config: TrainConfig) -> float:
        """Clip the gradient and take the AdamW step (skipped, with a warning, on a non-finite norm)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            warnings.warn(f"artnb: gradient norm is {grad_norm}; the update was skipped", stacklevel=3)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_sft(
        self,
        sequences: list[TokenizedSequence],
        learning_rate: float,
        *,
        max_grad_norm: float = 1.0,
        weight_decay: float = 0.0,
        micro_batch_tokens: int = 2048,
    ) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning on `sequences` (one batch); returns metrics as floats.

        The loss is the cross-entropy of the trainable tokens (`assistant_mask`) given the tokens before them,
        averaged over the batch's trainable tokens, so micro-batching does not change the gradient. Same
        adapter, AdamW and micro-batches as `train`; logprobs and advantages are ignored.
        """
        started = time.perf_counter()
        trainable = sft_sequences(sequences, self.max_seq_length)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate  # 0 is allowed: ART's decaying schedules end there
            group["weight_decay"] = weight_decay
        batches = self._local_batches(trainable, micro_batch_tokens)
        sums = LossSums(trainable_tokens(trainable))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for batch in batches:
            logprobs = self._logprobs(batch)
            loss = -torch.where(batch.mask, logprobs, 0.0).sum() / sums.denominator
            loss.backward()
            sums.count(batch, loss.item())
            del logprobs, loss
        sums = self._all_ranks(sums)
        grad_norm = self._apply_update(TrainConfig(max_grad_norm=max_grad_norm))
        seconds = time.perf_counter() - started
        return {
            "loss": sums.loss,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "num_trainable_tokens": float(sums.denominator),
            "num_sequences": float(len(sequences)),
            "num_micro_batches": float(sums.micro_batches),
            "tokens_per_second": sums.tokens / seconds,
            "seconds": seconds,
        }

    def reset_optimizer(self) -> None:
        """Forget the AdamW moments (as ART does between SFT and RL: their gradients differ in scale)."""
        self.optimizer = self._new_optimizer()

    def free_memory(self) -> None:
        """Give cached GPU memory back (activations of the step just taken) before the engine wakes on the same
        GPU; nothing to do on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Nothing to stop: this trainer lives in the calling process."""

    @torch.no_grad()
    def token_logprobs(self, token_ids: list[list[int]], *, adapter: bool = True) -> list[list[float]]:
        """logprob of each token given the ones before it (NaN for the first), as the engine reports them.

        `adapter=False` gives the base model's. Uses eval mode (no LoRA dropout).
        """
        was_training = self.model.training
        self.model.eval()
        try:
            out = []
            for ids in token_ids:
                if len(ids) < 2:
                    out.append([math.nan] * len(ids))
                    continue
                seq = TokenizedSequence(ids, [True] * len(ids), [math.nan] * len(ids), 0.0, 0, 0)
                batch = self._micro_batches([seq], max(len(ids), 1))[0]
                values = self._logprobs(batch, adapter=adapter)[0].float().tolist()
                out.append([math.nan, *values])
            return out
        finally:
            self.model.train(was_training)

    # ----- internals ---------------------------------------------------------------------------------------

    def _new_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=TrainConfig().learning_rate, betas=(0.9, 0.99), weight_decay=0.0)

    def _logprobs(self, batch: MicroBatch, adapter: bool = True, chunk_size: int | None = None) -> Tensor:
        """[B, K] logprob of `batch.targets`; without the adapter under no_grad (reference model).

        With `chunk_size`, and more kept positions than that, the LM head and log_softmax run chunk by chunk
        (`_chunked_logprobs`); the values are the same.
        """
        if not adapter:
            with torch.no_grad(), self.model.disable_adapter():
                return self._logprobs(batch, chunk_size=chunk_size)
        inputs, keep = self._inputs(batch)
        if chunk_size is not None and batch.targets.numel() > chunk_size and self._can_chunk_logprobs():
            return self._chunked_logprobs(inputs, keep, batch, chunk_size)
        if self._keeps_logits:
            logits = self.model(**inputs, logits_to_keep=keep).logits
        else:  # the few causal LMs without logits_to_keep (e.g. Whisper, ProphetNet): all logits, then select
            logits = self.model(**inputs).logits[:, keep]
        return logits.float().log_softmax(-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def _inputs(self, batch: MicroBatch) -> tuple[dict, Tensor]:
        """The model's inputs for `batch`, and the positions to keep logits at, counted in those inputs.

        With a shared prefix, the decoder runs on it once (one row) and its key/value cache, repeated per row,
        stands in for it in every row: the rows' forward and backward then cover only what follows it. The
        gradient flows back through the cache into the prefix's single pass, so it is the same gradient."""
        if not batch.prefix_len:
            return {
                "input_ids": batch.input_ids,
                "attention_mask": batch.attention_mask,
                "use_cache": False,
            }, batch.keep
        rows, width, shared = *batch.input_ids.shape, batch.prefix_len
        base = self._base_model()
        body = getattr(base, base.base_model_prefix)
        cache = body(input_ids=batch.input_ids[:1, :shared], use_cache=True).past_key_values
        cache.batch_repeat_interleave(rows)
        positions = torch.arange(shared, width, device=self.device).expand(rows, -1)
        inputs = {
            "input_ids": batch.input_ids[:, shared:],
            "attention_mask": batch.attention_mask,
            "position_ids": positions,
            "past_key_values": cache,
            "use_cache": True,
        }
        return inputs, batch.keep - shared

    def _shares_prefixes(self) -> bool:
        """Whether micro-batches may run their shared prefix once: it needs the decoder's key/value cache,
        which gradient checkpointing turns off."""
        return self.config.share_prefixes and self._keeps_logits and not self.config.gradient_checkpointing

    def _chunked_logprobs(self, inputs: dict, keep: Tensor, batch: MicroBatch, chunk_size: int) -> Tensor:
        """The decoder's hidden states at the kept positions, then head + log_softmax + gather per `chunk_size`
        positions (rows and positions flattened). Under autograd each chunk is checkpointed: its logits are
        freed after the forward and recomputed in backward, so one chunk's [chunk_size, vocab] is the peak."""
        base = self._base_model()
        head = base.get_output_embeddings()
        assert head is not None  # _can_chunk_logprobs found one
        hidden = getattr(base, base.base_model_prefix)(**inputs).last_hidden_state[:, keep]
        flat, targets = hidden.flatten(0, 1), batch.targets.flatten()
        recompute = torch.is_grad_enabled() and flat.requires_grad
        parts = []
        for start in range(0, len(flat), chunk_size):
            args = (head, flat[start : start + chunk_size], targets[start : start + chunk_size])
            if recompute:
                parts.append(torch.utils.checkpoint.checkpoint(_head_logprobs, *args, use_reentrant=False))
            else:
                parts.append(_head_logprobs(*args))
        return torch.cat(parts).view_as(batch.targets)

    def _can_chunk_logprobs(self) -> bool:
        """Whether the logits are the output embedding of the decoder's last hidden state, which chunking needs;
        checked once, on a few tokens, against the model's own forward."""
        if self._chunkable is None:
            self._chunkable = self._logits_are_head_of_decoder()
            if not self._chunkable:
                report_ignored(
                    "logprob_calculation_chunk_size",
                    f"{type(self._base_model()).__name__}'s logits are not just its output embedding "
                    "of the decoder's hidden states (soft-capping or scaling), so they are computed in one go",
                )
        return self._chunkable

    @torch.no_grad()
    def _logits_are_head_of_decoder(self) -> bool:
        base = self._base_model()
        body = getattr(base, getattr(base, "base_model_prefix", ""), None)
        head = base.get_output_embeddings()
        if not self._keeps_logits or body is None or head is None:
            return False
        ids = torch.arange(1, 9, device=self.device).unsqueeze(0) % head.weight.shape[0]
        was_training = self.model.training
        self.model.eval()
        try:
            full = self.model(input_ids=ids, use_cache=False).logits.float()
            split = head(body(input_ids=ids, use_cache=False).last_hidden_state).float()
        finally:
            self.model.train(was_training)
        return full.shape == split.shape and torch.allclose(full, split, rtol=1e-3, atol=1e-3)

    def _micro_batches(self, sequences: list[TokenizedSequence], budget: int) -> list[MicroBatch]:
        """Sequences sorted by length, cut into runs that cost the fewest token passes: each micro-batch runs
        its shared prefix once plus rows x (its longest row - the prefix), padding included, within `budget`
        (a longer sequence goes alone). Rows of similar length go together, so little is spent on padding."""
        ordered = sorted(sequences, key=lambda s: len(s.token_ids), reverse=True)
        shared = _shared_prefix(ordered) if self._shares_prefixes() and len(ordered) > 1 else 0
        return [self._collate(run) for run in _cheapest_runs(ordered, shared, budget)]

    def _collate(self, sequences: list[TokenizedSequence]) -> MicroBatch:
        rows, width = len(sequences), max(len(s.token_ids) for s in sequences)
        shared = _shared_prefix(sequences) if rows > 1 and self._shares_prefixes() else 0
        input_ids = torch.full((rows, width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, width - 1), dtype=torch.bool)
        old = torch.full((rows, width - 1), math.nan, dtype=torch.float32)
        advantages = torch.zeros((rows, width - 1), dtype=torch.float32)
        for i, seq in enumerate(sequences):
            n = len(seq.token_ids)
            input_ids[i, :n] = torch.tensor(seq.token_ids, dtype=torch.long)
            attention_mask[i, :n] = 1
            mask[i, : n - 1] = torch.tensor(seq.assistant_mask[1:], dtype=torch.bool)
            old[i, : n - 1] = torch.tensor(seq.logprobs[1:], dtype=torch.float32)
            advantages[i, : n - 1] = seq.advantage
        keep = mask.any(0).nonzero().squeeze(-1)
        dev = self.device
        return MicroBatch(
            input_ids=input_ids.to(dev),
            attention_mask=attention_mask.to(dev),
            keep=keep.to(dev),
            targets=input_ids[:, keep + 1].to(dev),
            mask=mask[:, keep].to(dev),
            old_logprobs=old[:, keep].to(dev),
            advantages=advantages[:, keep].to(dev),
            num_tokens=int(attention_mask.sum()),
            prefix_len=shared if shared >= _MIN_SHARED_PREFIX else 0,
        )

    def _check_adapter_config(self, saved: dict, path: Path) -> None:
        ours = cast("LoraConfig", self.model.peft_config["default"])  # the adapter _load_model made
        expected = {
            "r": ours.r,
            "lora_alpha": ours.lora_alpha,
            "target_modules": sorted(ours.target_modules or []),
        }
        found = {
            "r": saved.get("r"),
            "lora_alpha": saved.get("lora_alpha"),
            "target_modules": sorted(saved.get("target_modules") or []),
        }
        if found != expected:
            raise ValueError(
                f"adapter in {path} was trained with {found}, but this trainer has {expected}; "
                "use the same LoRAConfig to resume"
            )


def context_length(model_config) -> int:
    """A model config's context length (`max_position_embeddings` or its equivalent; 2048 if it names none)."""
    cfg = getattr(model_config, "text_config", None) or model_config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def check_sequences(
    sequences: list[TokenizedSequence], max_seq_length: int, asked: int | None = None
) -> None:
    """Raise ValueError, naming the sequence, if one cannot be trained on (ragged fields, too short or long).
    `asked`: the step's TrainConfig.max_seq_length, named when it let a sequence past the context through."""
    for i, seq in enumerate(sequences):
        n = len(seq.token_ids)
        if len(seq.assistant_mask) != n or len(seq.logprobs) != n:
            raise ValueError(
                f"sequence {i}: token_ids, assistant_mask and logprobs have lengths "
                f"{n}, {len(seq.assistant_mask)}, {len(seq.logprobs)}; they must be equal"
            )
        if n < 2:
            raise ValueError(f"sequence {i} has {n} token(s); training needs at least 2")
        if n > max_seq_length:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the model's context length {max_seq_length}"
                + (
                    f", which TrainConfig.max_seq_length={asked} lets through: set max_seq_length to at most "
                    f"{max_seq_length}, and longer sequences train on their first tokens"
                    if asked is not None and asked > max_seq_length
                    else "; set TrainConfig.max_seq_length to at most that, or shorten the rollouts"
                )
            )


def grpo_sequences(
    sequences: list[TokenizedSequence], config: TrainConfig, max_seq_length: int
) -> list[TokenizedSequence]:
    """The sequences a GRPO step trains on, advantages balanced (`advantage_balance`); ValueError when there
    are none or one is malformed. The FSDP trainer calls it in the notebook so that errors are raised there."""
    if not sequences:
        raise ValueError("train() got no sequences; the caller should skip the step instead")
    check_sequences(sequences, max_seq_length, config.max_seq_length)
    # token 0 is never predicted, so a mask only on it trains nothing; such rows are not run at all
    trainable = [s for s in sequences if any(s.assistant_mask[1:])]
    if not trainable:
        raise ValueError(
            f"no trainable tokens in any of the {len(sequences)} sequences (no assistant token after the "
            "first). Either the assistant turns are plain dicts without logprobs (return the engine's Choice "
            "objects, or set TrainConfig.allow_training_without_logprobs=True) or every sampled completion is "
            "empty (max_tokens=0, or a stop at the first token)"
        )
    if config.advantage_balance:
        trainable = [
            replace(s, advantage=grpo.balance_advantage(s.advantage, config.advantage_balance))
            for s in trainable
        ]
    return trainable


def sft_sequences(sequences: list[TokenizedSequence], max_seq_length: int) -> list[TokenizedSequence]:
    """The sequences an SFT step trains on; ValueError when there are none or one is malformed."""
    check_sequences(sequences, max_seq_length)
    trainable = [s for s in sequences if any(s.assistant_mask[1:])]  # token 0 is never predicted
    if not trainable:
        raise ValueError("train_sft() got no trainable tokens: every assistant_mask is False")
    return trainable


def trainable_tokens(sequences: list[TokenizedSequence]) -> int:
    """The tokens a step's loss is divided by: trainable ones after the first (which nothing predicts)."""
    return sum(sum(s.assistant_mask[1:]) for s in sequences)


def _shared_prefix(sequences: list[TokenizedSequence]) -> int:
    """How many leading tokens all `sequences` share before any of them has a trainable one; the logits that
    predict the first trainable token come after it, so nothing trained lies in the prefix."""
    first = sequences[0].token_ids
    limit = min(min(len(s.token_ids) for s in sequences) - 1, *(_first_trainable(s) - 1 for s in sequences))
    shared = 0
    while shared < limit and all(s.token_ids[shared] == first[shared] for s in sequences):
        shared += 1
    return shared


def _cheapest_runs(
    ordered: list[TokenizedSequence], shared: int, budget: int
) -> list[list[TokenizedSequence]]:
    """Split `ordered` (longest first) into consecutive runs minimising the tokens run: per run, `shared` +
    rows x (longest - shared) + a fixed cost per pass (_PASS_COST); a run fits `budget` unless it is one row.
    Dynamic programming over the split points (n^2 for n sequences, a few ms for hundreds)."""
    lengths = [len(s.token_ids) for s in ordered]
    best = [0.0] + [math.inf] * len(ordered)  # best[j]: cheapest cost of ordered[:j]
    cut = [0] * (len(ordered) + 1)
    for end in range(1, len(ordered) + 1):
        for start in range(end - 1, -1, -1):
            rows, width = end - start, lengths[start] - shared
            cost = shared + rows * width
            if rows > 1 and cost > budget:
                break  # earlier starts only add rows
            if best[start] + cost + _PASS_COST < best[end]:
                best[end], cut[end] = best[start] + cost + _PASS_COST, start
    runs, end = [], len(ordered)
    while end:
        runs.append(ordered[cut[end] : end])
        end = cut[end]
    return runs[::-1]


def _first_trainable(sequence: TokenizedSequence) -> int:
    return next((i for i, m in enumerate(sequence.assistant_mask) if m and i > 0), len(sequence.token_ids))


def _head_logprobs(head: torch.nn.Module, hidden: Tensor, targets: Tensor) -> Tensor:
    """logprob of each target token from hidden states [N, H] through the LM head: [N]."""
    return head(hidden).float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def present_target_modules(model: torch.nn.Module, wanted: list[str]) -> list[str]:
    """The names in `wanted` that match a module of `model` (by last dotted component), in order."""
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    present = [t for t in wanted if t in leaves]
    if not present:
        linear = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        raise ValueError(
            f"LoRA target_modules {wanted} match no module of {type(model).__name__}; "
            f"its linear layers are named {linear}"
        )
    missing = [t for t in wanted if t not in leaves]
    if missing:
        warnings.warn(
            f"artnb: LoRA target_modules {missing} do not exist in {type(model).__name__}; adapting {present}",
            stacklevel=3,
        )
    return present


def _pad_token_id(config) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0
