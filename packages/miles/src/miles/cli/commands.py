"""The `miles` subcommands that do work: train, plot, report, export-hf."""

from __future__ import annotations

import argparse
import logging
import sys

from miles.utils.plugins import TRAIN_BACKENDS, load_plugin


def run_train(argv: list[str]) -> int:
    """`miles train [flags]`: parse and validate the configuration, then run the loop."""
    from miles.config import load_config

    try:
        config = load_config(argv)
    except (ValueError, ImportError) as err:
        print(f"miles train: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.logging.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    from miles.train import train
    from miles.utils.divergence import DivergenceError
    from miles.utils.run_dirs import RunDirectoryError

    try:
        train(config)
    except RunDirectoryError as err:  # found before anything started: one line is the story
        print(f"miles train: error: {err}", file=sys.stderr)
        return 2
    except DivergenceError as err:  # every rollout so far is logged; the cause is the story
        print(f"miles train: stopped: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # the cause first; Ray's tracebacks go to a file
        from miles.utils.failures import describe, write_failure_log

        log = write_failure_log(config.logging.output_dir, err)
        print(f"miles train: failed: {describe(err)}\n(full traceback: {log})", file=sys.stderr)
        if config.observability.use_mlflow:
            _attach_to_mlflow(config.logging.output_dir, log)
        return 1
    return 0


def _attach_to_mlflow(output_dir: str, log: object) -> None:
    from miles.utils.observability.mlflow_tracking import attach_failure_log

    try:
        run_id = attach_failure_log(output_dir, str(log))
    except Exception as err:  # the run's own failure is the story; say this one after it
        print(f"miles train: could not attach {log} to MLflow: {err}", file=sys.stderr)
        return
    if run_id is not None:
        print(f"(attached to MLflow run {run_id})", file=sys.stderr)


def run_report(args: argparse.Namespace) -> int:
    from miles.utils.observability.report_html import write_report

    try:
        path = write_report(args.run_dir, args.out)
    except FileNotFoundError as err:
        print(f"miles report: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def run_plot(args: argparse.Namespace) -> int:
    from miles.utils.plotting import plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"miles plot: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def run_export_hf(args: argparse.Namespace) -> int:
    actor_class = load_plugin(TRAIN_BACKENDS, args.train_backend)
    export = getattr(actor_class, "export_checkpoint", None)
    if export is None:
        print(
            f"miles export-hf: error: the {args.train_backend} backend cannot export its "
            "checkpoints offline; export from a running job with export_hf()",
            file=sys.stderr,
        )
        return 2
    options = {"adapter_only": True} if args.adapter_only else {}
    try:
        source = export(args.checkpoint, args.out_dir, hf_checkpoint=args.hf_checkpoint, **options)
    except (FileNotFoundError, ValueError) as err:
        print(f"miles export-hf: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {source} to {args.out_dir}")
    return 0
