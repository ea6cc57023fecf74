"""TRL's GRPOTrainer on the a+b task, in TRL's own virtual environment: the baseline of grpo_vs_trl.py.

benchmarks/grpo_vs_trl.py runs this file with the TRL environment's python (TRL is no dependency of artnb, and its
own requirements must not move artnb's venv) and reads the JSON it writes. It runs on its own too:

    /tmp/trl-venv/bin/python benchmarks/_trl_ab_worker.py --model DIR --steps 2 --out /tmp/trl-ab.json

where DIR is the embedded model's fp32 directory (`python -c "import artnb.models as m;
print(m.embedded_model_path())"` in artnb's venv). It imports nothing from artnb, only benchmarks/_ab_task.py.

The settings mirror artnb's defaults, so the two runs differ only in the framework:
- one prompt per optimizer step: per_device_train_batch_size = num_generations = G, no gradient accumulation
  (generation_batch_size is then one group of G completions);
- LoRA r=8, alpha=16, dropout 0 on all seven linear projections (artnb's LoRAConfig);
- AdamW betas (0.9, 0.99), no weight decay, gradient clipping at 1.0, a constant learning rate (Trainer's
  default schedule decays linearly to 0; artnb's does not);
- fp32 on the CPU, transformers `generate` (no vLLM), no gradient checkpointing (GRPOConfig turns it on by
  default; artnb's TrainerConfig leaves it off), beta = 0 (no reference model), temperature 1, top-p 1, no top-k;
- TRL's default loss ("dapo"). With one update per batch the importance ratio is exactly 1 in TRL, where
  "dapo" and "cispo" both reduce to the token-mean policy gradient A * grad(logp) that artnb's default "cispo"
  takes (its ratio is the trainer/engine ratio, ~1).

Timing: a step is the wall time between consecutive `on_step_end` callbacks (the first from `on_train_begin`),
so it holds everything the trainer does in a step; rollout is `_generate_and_score_completions` (generation,
reward, advantages), train is the rest (forward, backward, optimizer step, logging).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _ab_task, when started from another directory
import _ab_task as task  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def versions() -> dict[str, str]:
    """Versions of the packages that decide TRL's speed, as installed in this environment."""
    return {
        name: version(name) for name in ("trl", "transformers", "peft", "torch", "accelerate", "datasets")
    }


def ab_reward(completions: list[list[dict[str, str]]], answer: list[int], **_: object) -> list[float]:
    """GRPOTrainer's reward-function signature around the shared `_ab_task.reward`."""
    return [
        task.reward(completion[-1]["content"], int(a))
        for completion, a in zip(completions, answer, strict=True)
    ]


def run(model: str, steps: int, group_size: int, lr: float, max_tokens: int, seed: int) -> dict[str, object]:
    """Train `steps` GRPO steps with TRL and return the per-step seconds and rewards."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records how long each rollout (generate + score) takes; nothing else changes."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.rollout_s: list[float] = []

        def _generate_and_score_completions(self, inputs):
            started = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.rollout_s.append(time.perf_counter() - started)
            return out

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.reward: list[float] = []
            self.equal_rewards: list[bool] = []  # the group's rewards were all equal: zero advantages
            self.last = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.reward.append(float(logs["reward"]))
                self.equal_rewards.append(float(logs["frac_reward_zero_std"]) == 1.0)

    dataset = Dataset.from_list(
        [{"prompt": task.messages(a, b), "answer": a + b} for a, b in task.problems(steps, seed)]
    )
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-ab-"),
        max_steps=steps,
        per_device_train_batch_size=group_size,
        gradient_accumulation_steps=1,
        num_generations=group_size,
        max_completion_length=max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        shuffle_dataset=False,  # the prompts in _ab_task's order, as artnb sees them
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    clock = StepClock()
    started = time.perf_counter()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=ab_reward,
        args=config,
        train_dataset=dataset,
        peft_config=lora,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    if not (len(clock.step_s) == len(trainer.rollout_s) == len(clock.reward) == steps):
        raise RuntimeError(
            f"expected {steps} steps, each with one rollout and one logged reward; got {len(clock.step_s)} "
            f"steps, {len(trainer.rollout_s)} rollouts, {len(clock.reward)} rewards (did TRL change how "
            "GRPOTrainer batches or logs?)"
        )
    return {
        "framework": f"TRL {version('trl')} GRPOTrainer",
        "versions": versions(),
        "threads": torch.get_num_threads(),
        "setup_s": setup_s,
        "step_s": clock.step_s,
        "rollout_s": trainer.rollout_s,
        "reward": clock.reward,
        "equal_rewards": clock.equal_rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="directory of the fp32 model (the embedded one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args()
    result = run(args.model, args.steps, args.group_size, args.lr, args.max_tokens, args.seed)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
