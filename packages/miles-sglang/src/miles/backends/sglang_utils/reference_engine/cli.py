"""`miles-reference-engine`: serve a transformers causal LM with SGLang's HTTP API."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import uvicorn

from miles.backends.sglang_utils.reference_engine.config import DTYPES, ReferenceEngineConfig
from miles.backends.sglang_utils.reference_engine.engine import ReferenceEngine
from miles.backends.sglang_utils.reference_engine.lora_settings import (
    ALL_TARGETS,
    LORA_TARGET_MODULES,
)
from miles.backends.sglang_utils.reference_engine.server import create_app
from miles.backends.sglang_utils.server_process import ADMIN_KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles-reference-engine",
        description="Serve a Hugging Face causal LM with SGLang's native HTTP API (CPU or GPU).",
    )
    parser.add_argument("--model-path", required=True, help="checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES))
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument(
        "--admission-quiet-ms",
        type=float,
        default=2.0,
        help="an idle engine prefills once no request arrived for this long (0: at once)",
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"key of the weight, memory, pause and abort routes (default: ${ADMIN_KEY_ENV})",
    )
    parser.add_argument("--max-queued-requests", type=int, default=4096)
    parser.add_argument("--max-request-bytes", type=int, default=64 << 20)
    parser.add_argument(
        "--served-model-name", default=None, help="model id of /v1/* (default: --model-path)"
    )
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda:1")
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record a MoE model's routing for requests with return_routed_experts",
    )
    parser.add_argument(
        "--disable-fast-decode",
        action="store_true",
        help="decode through the Hugging Face forward, not the engine's own decode step",
    )
    lora = parser.add_argument_group("LoRA serving (SGLang's flags)")
    lora.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)"
    )
    lora.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank")
    lora.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        choices=[*LORA_TARGET_MODULES, ALL_TARGETS],
        help="the projections adapters may adapt",
    )
    lora.add_argument(
        "--max-loras-per-batch", type=int, default=8, help="distinct adapters in one batch"
    )
    lora.add_argument(
        "--lora-paths", nargs="+", default=None, help="adapters to load at start: NAME=PATH ..."
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    # The HTTP server's own parts (uvicorn's names); "auto" takes httptools and uvloop, which
    # the package installs, and falls back to h11 and asyncio.
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    return parser


_SERVER_OPTIONS = ("log_level", "http", "loop")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags that configure the engine (`ReferenceEngineConfig`'s fields), without
    those of the HTTP server."""
    return {k: v for k, v in vars(args).items() if k not in _SERVER_OPTIONS}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    options = engine_options(args)
    try:
        config = ReferenceEngineConfig(**options)
        # The model and the --lora-paths adapters are checked as they load.
        engine = ReferenceEngine(config)
    except ValueError as err:
        print(f"miles-reference-engine: {err}", file=sys.stderr)
        return 2
    # A long keep-alive: clients pool connections between rollouts (theirs expire first).
    uvicorn.run(
        create_app(engine),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        timeout_keep_alive=60,
        http=args.http,
        loop=args.loop,
    )
    engine.scheduler.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
