"""The `artnb` command: `artnb demo [--steps N] [--ruler]`."""

from __future__ import annotations

import argparse
import dataclasses


def main(argv: list[str] | None = None) -> None:
    from .demo import DemoConfig

    parser = argparse.ArgumentParser(prog="artnb", description="Jupyter-first GRPO for LLM agents")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the embedded model on tic-tac-toe and write an HTML report")
    for f in dataclasses.fields(DemoConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(f.default, bool):
            demo.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            demo.add_argument(flag, type=type(f.default), default=f.default)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)}))


if __name__ == "__main__":
    main()
