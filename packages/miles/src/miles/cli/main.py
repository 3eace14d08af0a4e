"""Entry point of the `miles` command: parses the subcommand and hands over to it."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from miles.backends.training_utils.device import get_device_info
from miles.utils.plugins import ROLLOUT_ENGINES, TRAIN_BACKENDS, installed_plugins

MILES_WHEELS = ("miles", "miles-training-utils", "miles-sglang", "miles-fsdp", "miles-megatron")


def installed_wheel_versions() -> dict[str, str]:
    """Versions of the miles wheels present in this environment."""
    versions = {}
    for wheel in MILES_WHEELS:
        try:
            versions[wheel] = version(wheel)
        except PackageNotFoundError:
            continue
    return versions


def _print_info(_: argparse.Namespace) -> int:
    device = get_device_info()
    print(f"device: {device.kind} x{device.count} (distributed backend: {device.dist_backend})")
    for wheel, ver in installed_wheel_versions().items():
        print(f"wheel: {wheel} {ver}")
    for label, group in (("train backends", TRAIN_BACKENDS), ("rollout engines", ROLLOUT_ENGINES)):
        names = sorted(installed_plugins(group)) or ["none installed"]
        print(f"{label}: {', '.join(names)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles",
        description="miles: reinforcement-learning post-training for large language models.",
    )
    parser.add_argument("--version", action="version", version=f"miles {version('miles')}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = subcommands.add_parser(
        "info", help="show the detected device, the installed miles wheels and backends"
    )
    info.set_defaults(handler=_print_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 0
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
