"""The `artnb` command: `artnb demo [--steps N] [--ruler [--judge MODEL]]`, `artnb serve [--path DIR] [--host H] [--port N] ...`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .core.config import TrainerConfig


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
    _add_serve(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(DemoConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DemoConfig)}))
    elif args.command == "serve":
        _serve(parser, args)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from .backends.server import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_PORT
    from .backends.trainers.choice import TRAINER_KINDS

    serve = sub.add_parser(
        "serve",
        help="serve a LocalBackend over HTTP for art.RemoteBackend (training and the models' OpenAI endpoints)",
        description="Serve this machine's backend to notebooks elsewhere: `art.RemoteBackend(base_url, api_key)`. "
        "Every route but /health needs the API key; without one only 127.0.0.1 is allowed (use an SSH tunnel).",
    )
    serve.add_argument("--path", default="./.art", help="the run directories (default ./.art)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}, as ART's)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help=f"the key clients must send (default: ${API_KEY_ENV}, which keeps it out of `ps`); "
        "required unless --host is a loopback address",
    )
    serve.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="inference engine")
    serve.add_argument(
        "--trainer",
        choices=list(TRAINER_KINDS),
        default="auto",
        help="trainer (default auto); fsdp trains on every GPU, across nodes when torchrun started its ranks",
    )
    serve.add_argument(
        "--trainer-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="art.TrainerConfig fields as a JSON object, e.g. '{\"gradient_checkpointing\": true}' or, with "
        '--trainer fsdp, \'{"placement": "split"}\' (vLLM on half the GPUs, awake)',
    )
    serve.add_argument(
        "--engine-options",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='engine settings as a JSON object, e.g. \'{"extra_args": ["--max-model-len", "4096"]}\'',
    )
    serve.add_argument(
        "--gpu-cost-per-hour-usd",
        type=float,
        default=None,
        metavar="USD",
        help="the machine's price per hour: each step's history row gets costs/gpu/usd (ART's keyword)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"larger request bodies get 413 before they are read (default {DEFAULT_MAX_REQUEST_BYTES // 2**20} "
        "MiB: about 2.5M sampled tokens with their logprobs per train call)",
    )


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from .backends.local import check_run_path
    from .backends.machine_bill import checked_price
    from .backends.server import API_KEY_ENV, check_bind, serve

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        if not 1 <= args.port <= 65535:
            raise ValueError(f"--port {args.port}: pass a TCP port from 1 to 65535")
        if args.max_request_bytes <= 0:
            raise ValueError(f"--max-request-bytes {args.max_request_bytes}: pass a positive number of bytes")
        if args.engine_options is not None and not isinstance(args.engine_options, dict):
            raise ValueError(
                f"--engine-options {json.dumps(args.engine_options)}: give a JSON object of engine settings, "
                'e.g. \'{"extra_args": ["--max-model-len", "4096"]}\''
            )
        check_run_path(args.path, "--path")
        check_bind(args.host, api_key)
        trainer_config = _trainer_config(args.trainer_config)
        if trainer_config is not None:
            from .backends.trainers.choice import check_placement

            check_placement(
                args.trainer, trainer_config, f"--trainer-config {json.dumps(args.trainer_config)}"
            )
        if args.gpu_cost_per_hour_usd is not None:
            checked_price(args.gpu_cost_per_hour_usd)  # a bad price fails before the server listens
    except ValueError as error:
        parser.exit(2, f"artnb serve: {error}\n")
    serve(
        args.path,
        host=args.host,
        port=args.port,
        api_key=api_key,
        engine=args.engine,
        trainer=args.trainer,
        trainer_config=trainer_config,
        max_request_bytes=args.max_request_bytes,
        engine_options=args.engine_options,
        gpu_cost_per_hour_usd=args.gpu_cost_per_hour_usd,
    )


def _trainer_config(fields: object) -> TrainerConfig | None:
    """`--trainer-config`'s JSON as a TrainerConfig; a ValueError naming the bad field."""
    from pydantic import ValidationError

    from .core.config import TrainerConfig

    if fields is None:
        return None
    if not isinstance(fields, dict):
        raise ValueError(
            f"--trainer-config {json.dumps(fields)}: give a JSON object of art.TrainerConfig fields"
        )
    try:
        return TrainerConfig.model_validate(fields)
    except ValidationError as error:
        raise ValueError(f"--trainer-config: {error}") from None


if __name__ == "__main__":
    main()
