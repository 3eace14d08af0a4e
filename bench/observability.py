"""What MLflow and Prometheus cost a rollout: `bench/e2e_vs_trl.py`'s miles workload, run twice in
one process, without and with `--use-mlflow --use-prometheus` (the /metrics endpoint scraped every
second meanwhile, as a Prometheus server would, more often than its 15 s default).

The step times of two runs differ by more than 2% on a shared machine whatever they do, so the
overhead is also measured where it is paid: the driver's time inside `Tracker.log` per rollout
(the JSONL file alone in the first run; with MLflow's enqueue and the Prometheus update in the
second). MLflow writes in its own thread: the driver's CPU time per rollout, with and without,
bounds what that thread and the /metrics server take from the step (the scraper runs in the driver
too, so the bound counts both ends of each scrape). The script prints all three, and the one-off
costs: the start-up (MLflow opens its store in a thread meanwhile) and the teardown (MLflow's
queue, the plots as artifacts). Numbers: docs/guides/observability.md, "What it costs".

    uv run --frozen python bench/observability.py [--steps 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_vs_trl  # the sibling benchmark whose workload this reuses


class TimedLog:
    """Wraps `Tracker.log` and keeps the seconds of each call (the run's records, one a rollout)."""

    def __init__(self) -> None:
        from miles.utils.tracking import Tracker

        self.seconds: list[float] = []
        self._original = Tracker.log
        timed = self

        def log(tracker, metrics, *, step):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return timed._original(tracker, metrics, step=step)
            finally:
                timed.seconds.append(time.perf_counter() - start)

        Tracker.log = log  # type: ignore[method-assign]

    def take(self) -> list[float]:
        seconds, self.seconds = self.seconds, []
        return seconds


def scrape_every_second(url: str, stop: threading.Event, answers: list[int]) -> None:
    while not stop.wait(1.0):
        try:
            answers.append(len(urllib.request.urlopen(url, timeout=5).read()))
        except OSError:
            continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="measured RL steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=16)
    args = parser.parse_args()
    workload = argparse.Namespace(
        steps=args.steps, warmup=args.warmup, prompts=args.prompts, samples=args.samples,
        response_len=args.response_len, lr=1e-5, max_tokens_per_gpu=4096, miles_flag=[],
    )  # fmt: skip
    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    timed = TimedLog()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = build_tiny_checkpoint(
            root / "ckpt", seed=0, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        )  # fmt: skip
        data = root / "prompts.jsonl"
        e2e_vs_trl.write_prompts(data)
        for name in ("off", "on"):
            stop, answers = threading.Event(), []
            if name == "on":
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                workload.miles_flag = ["--use-mlflow", "--use-prometheus",
                                       "--prometheus-port", str(port)]  # fmt: skip
                url = f"http://127.0.0.1:{port}/metrics"
                threading.Thread(
                    target=scrape_every_second, args=(url, stop, answers), daemon=True
                ).start()
            result = e2e_vs_trl.run_miles(workload, checkpoint, data, root / name)
            stop.set()
            log_s = timed.take()[args.warmup :]
            results[name] = {**result, "log_s": log_s, "scrapes": len(answers)}
    report(results)


def report(results: dict[str, dict]) -> None:
    off, on = results["off"], results["on"]
    step_on = on["step_s"]["median"]
    log_extra = statistics.median(on["log_s"]) - statistics.median(off["log_s"])
    print(f"{'':34}{'off':>10}{'on':>10}")
    rows = [
        ("step s (median)", off["step_s"]["median"], step_on),
        ("step s (mean)", off["step_s"]["mean"], on["step_s"]["mean"]),
        ("Tracker.log s per rollout (median)", statistics.median(off["log_s"]),
         statistics.median(on["log_s"])),
        ("Tracker.log s per rollout (max)", max(off["log_s"]), max(on["log_s"])),
        ("driver CPU s per rollout", off["driver_cpu_per_rollout_s"],
         on["driver_cpu_per_rollout_s"]),
        ("start-up s", off["startup_s"], on["startup_s"]),
        ("teardown s", off["teardown_s"], on["teardown_s"]),
    ]  # fmt: skip
    for label, a, b in rows:
        print(f"{label:34}{a:>10.4f}{b:>10.4f}")
    print(f"/metrics scrapes during the 'on' run: {on['scrapes']}")
    print(f"MLflow + Prometheus in the loop: {log_extra * 1e3:.2f} ms per rollout = "
          f"{100 * log_extra / step_on:.3f}% of the step (median {step_on:.3f} s)")  # fmt: skip
    cpu_extra = on["driver_cpu_per_rollout_s"] - off["driver_cpu_per_rollout_s"]
    print(f"the driver's extra CPU (MLflow's writer thread, the /metrics server and scrapes): "
          f"{cpu_extra * 1e3:.1f} ms per rollout = {100 * cpu_extra / step_on:.2f}% of the step, "
          "if every bit of it delayed the step")  # fmt: skip
    change = 100 * (step_on - off["step_s"]["median"]) / off["step_s"]["median"]
    print(f"step time, on against off (median, includes the machine's noise): {change:+.1f}%")


if __name__ == "__main__":
    main()
