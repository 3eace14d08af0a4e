"""The `miles` subcommands that do work: train, plot, report, export-hf."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import TYPE_CHECKING

from miles.utils.plugins import TRAIN_BACKENDS, load_plugin

if TYPE_CHECKING:
    from miles.utils.graceful_stop import GracefulStop


def run_train(argv: list[str]) -> int:
    """`miles train [flags]`: parse and validate the configuration, then run the loop.

    Exit status: 0 finished; 1 failed (the cause on one line); 2 refused before start (a config
    or directory error); 128 + N stopped by signal N (143 SIGTERM, 130 SIGINT), with a checkpoint
    of the rollout in progress unless the line says otherwise (`miles.utils.graceful_stop`)."""
    from miles.utils.graceful_stop import GracefulStop

    stop = GracefulStop(grace_s=60.0)
    stop.install()  # from here on a Ctrl-C is a stop, never a traceback
    try:
        code, line = _train(argv, stop)
    except KeyboardInterrupt:  # a signal before the configuration was read: nothing started
        code, line = stop.exit_code, stop.line(latest=None, save=None)
    finally:
        stop.uninstall()
    if line:
        print(line, file=sys.stderr)
    return code


def _train(argv: list[str], stop: GracefulStop) -> tuple[int, str | None]:
    """(exit status, the last line to print) of one `miles train`."""
    from miles.config import load_config

    try:
        config = load_config(argv)
    except (ValueError, ImportError) as err:
        return 2, f"miles train: error: {err}"
    stop.grace_s = config.training.stop_grace_s
    logging.basicConfig(
        level=config.logging.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    from miles.ray.local_ray import stop_local_ray
    from miles.train import train
    from miles.utils.checkpoint_layout import latest_checkpoint_name
    from miles.utils.divergence import DivergenceError
    from miles.utils.run_dirs import RunDirectoryError

    keep_ray_logs = True  # a failed run's Ray session directory holds its processes' logs
    try:
        train(config, stop=stop)
        keep_ray_logs = False
    except RunDirectoryError as err:  # found before anything started: one line is the story
        return 2, f"miles train: error: {err}"
    except DivergenceError as err:  # every rollout so far is logged; the cause is the story
        return 1, f"miles train: stopped: {err}"
    except KeyboardInterrupt:  # stopped at once: a second signal, the grace over, start-up
        keep_ray_logs = False
        if not stop.requested:  # Ray turned some other interruption into this
            stop.signal = signal.SIGINT
    except Exception as err:  # the cause first; Ray's tracebacks go to a file
        from miles.utils.failures import describe, write_failure_log

        log = write_failure_log(config.logging.output_dir, err)
        print(f"miles train: failed: {describe(err)}\n(full traceback: {log})", file=sys.stderr)
        if config.observability.use_mlflow:
            _attach_to_mlflow(config.logging.output_dir, log)
        return 1, None
    finally:
        stop_local_ray(keep_session=keep_ray_logs)
    if not stop.requested:
        return 0, None
    save = config.checkpoint.save
    return stop.exit_code, stop.line(latest=latest_checkpoint_name(save) if save else None,
                                     save=save)  # fmt: skip


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
