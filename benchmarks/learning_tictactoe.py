"""Does it learn? Train the embedded model on tic-tac-toe for >= 20 steps and print the curve.

Baseline: the base model's own play (the first steps' rollouts come from the untrained adapter).
Usage: python benchmarks/learning_tictactoe.py [--steps 20] [--path /tmp/artnb-learning]
"""

import argparse
import shutil
import statistics

from artnb.demo import DemoConfig, main

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--path", default="/tmp/artnb-learning")
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
shutil.rmtree(args.path, ignore_errors=True)  # always from the base model
rows = main(
    DemoConfig(
        steps=args.steps, path=args.path, learning_rate=args.lr, report="reports/learning_tictactoe.html"
    )
)

print("\nlearning curve (tic-tac-toe vs random opponent, SmolLM2-135M, LoRA r=8)")
print(f"{'step':>4} {'reward':>7} {'legal':>6} {'win':>5} {'illegal':>7}")
for r in rows:
    print(
        f"{r['step']:>4} {r['reward']:>7.3f} {r['legal_move_rate']:>6.2f} {r['win']:>5.2f} {r['illegal']:>7.2f}"
    )
k = max(1, min(5, len(rows) // 4))
first, last = rows[:k], rows[-k:]
print(
    f"\n{'metric':<16} {'first ' + str(k) + ' steps (baseline)':>26} {'last ' + str(k) + ' steps':>14} {'ratio':>6}"
)
for key in ("reward", "legal_move_rate", "win"):
    a = statistics.fmean(r[key] for r in first)
    b = statistics.fmean(r[key] for r in last)
    print(f"{key:<16} {a:>26.3f} {b:>14.3f} {b / a if a else float('nan'):>6.2f}")
print(
    f"seconds per step: rollouts {statistics.fmean(r['rollout_s'] for r in rows):.1f}, "
    f"training {statistics.fmean(r['train_s'] for r in rows):.1f}"
)
