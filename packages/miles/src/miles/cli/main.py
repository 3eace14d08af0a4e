"""Entry point of the `miles` command: parses the subcommand and hands over to it."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from miles.cli.commands import run_export_hf, run_plot, run_report, run_train
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
    # Imported here: the device module imports torch, which `miles --help` must not wait for.
    from miles.backends.training_utils.infra.device import get_device_info

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
    train = subcommands.add_parser(
        "train",
        help="run RL training (see `miles train --help` for every setting)",
        add_help=False,  # `miles train --help` lists the run's settings, not this parser's
        prefix_chars="\0",  # hand every flag, unparsed, to the run's own parser
    )
    train.add_argument("argv", nargs=argparse.REMAINDER)
    train.set_defaults(handler=lambda args: run_train(args.argv))
    plot = subcommands.add_parser("plot", help="write PNG curves of a run's metrics")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="the --output-dir of a miles train run")
    plot.add_argument("--out", default=None, help="output directory (default: RUN_DIR/plots)")
    plot.set_defaults(handler=run_plot)
    report = subcommands.add_parser(
        "report", help="write one self-contained HTML page about a run (config, curves, time "
        "split, start-up, memory, failures, evaluation)",
    )  # fmt: skip
    report.add_argument("run_dir", metavar="RUN_DIR", help="the --output-dir of a miles train run")
    report.add_argument("--out", default=None, help="the HTML file (default: RUN_DIR/report.html)")
    report.set_defaults(handler=run_report)
    export = subcommands.add_parser(
        "export-hf", help="write a saved checkpoint as a Hugging Face model directory"
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a --save dir or an iter_* dir")
    export.add_argument("out_dir", metavar="OUT_DIR")
    export.add_argument("--hf-checkpoint", default=None, help="config/tokenizer source")
    export.add_argument("--train-backend", default="fsdp")
    export.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run's adapter as a PEFT directory (adapter_config.json, "
        "adapter_model.safetensors) instead of the merged model",
    )
    export.set_defaults(handler=run_export_hf)
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
