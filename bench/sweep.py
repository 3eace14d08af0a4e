"""miles and TRL across model sizes: `e2e_vs_trl.py`'s GRPO workload (8 prompts x 8 samples, 16
response tokens) on tiny Qwen3 models of about 3 M, 25 M and 100 M parameters, miles beside TRL on
one torch thread and on every core. Per size it prints each one's seconds per step, miles's split
(generate / train / weight sync), the step's FLOPs and its time over the compute floor
(`compute_floor.py`), miles's weight-sync rate (parameter bytes / `time/update_weights_s`) and
each process's peak resident memory, in one table at the end.

    uv run --frozen --with trl python bench/sweep.py [--sizes 3M,25M] [--steps 6] [--skip-trl]

Each (size, runner) is one run of `e2e_vs_trl.py` in a process of its own: a process's peak
memory is then that run's alone (a second run in the same process would start from the first's
peak), and TRL's thread count is set before torch starts. The runs' logs stay in --log-dir.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.utils.cpu_cores import usable_cores

E2E = Path(__file__).resolve().parent / "e2e_vs_trl.py"

# Qwen3 with 4 query heads and 2 key-value heads (e2e_vs_trl.py's), the MLP 3x the hidden size.
SIZES = {
    "3M": {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4},  # e2e's defaults
    "25M": {"hidden_size": 512, "intermediate_size": 1536, "num_layers": 8},
    "100M": {"hidden_size": 768, "intermediate_size": 2304, "num_layers": 14},  # 99.3 M
}


def runners(skip_trl: bool) -> dict[str, list[str]]:
    """{runner label: its e2e_vs_trl.py flags}: miles, then TRL on 1 thread and on every core."""
    found = {"miles": ["--skip-trl"]}
    if not skip_trl:
        cores = usable_cores()
        found["TRL 1 thread"] = ["--skip-miles", "--trl-threads", "1"]
        found[f"TRL {cores} threads"] = ["--skip-miles", "--trl-threads", str(cores)]
    return found


def run_cell(size: str, flags: list[str], args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """One e2e_vs_trl.py run; its JSON results, or the error and where its log is."""
    result = log.with_suffix(".json")
    model = [f"--{key.replace('_', '-')}={value}" for key, value in SIZES[size].items()]
    command = [sys.executable, str(E2E), *model, *flags,
               f"--steps={args.steps}", f"--warmup={args.warmup}", f"--json={result}"]  # fmt: skip
    print(f"[sweep] {size}: {' '.join(flags)} (log {log})", flush=True)
    began = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        return {"error": f"exit code {code}; see {log}"}
    print(f"[sweep]   done in {time.perf_counter() - began:.0f} s", flush=True)
    return json.loads(result.read_text())


def table(results: dict[str, dict[str, dict]]) -> str:
    """One row per (size, runner)."""
    header = (f"{'size':6}{'params':>9}  {'runner':15}{'s/step':>8}{'gen':>8}{'train':>8}"
              f"{'sync':>8}{'GFLOP':>8}{'floor s':>9}{'x floor':>8}{'sync GB/s':>10}  "
              "peak RSS MB")  # fmt: skip
    lines = [header]
    for size, by_runner in results.items():
        for runner, run in by_runner.items():
            if "error" in run:
                lines.append(f"{size:6}{'':>9}  {runner:15}failed: {run['error']}")
                continue
            params = f"{run['workload']['params'] / 1e6:.1f}M"
            result = run["trl"] if runner.startswith("TRL") else run["miles"]
            phases, step = result["compute"]["phases"], result["compute"]["step"]
            sync = result["split_median_s"].get("weight sync")  # TRL has none
            peaks = ", ".join(f"{k} {v:.0f}" for k, v in result["peak_rss_mb"].items())
            lines.append(
                f"{size:6}{params:>9}  {runner:15}{result['step_s']['median']:>8.3f}"
                f"{_cell(phases['generation']['seconds'])}{_cell(phases['training']['seconds'])}"
                f"{_cell(sync)}"
                f"{step['gflop']:>8.1f}{step['floor_s']:>9.3f}{step['step_over_floor']:>8.1f}"
                f"{_cell(result.get('weight_sync_gb_per_s'), 10, 2)}  {peaks}"
            )
    return "\n".join(lines)


def _cell(value: float | None, width: int = 8, digits: int = 3) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def machine_line(results: dict[str, dict[str, dict]]) -> str:
    """The sgemm rates each run measured (the floor of each row uses its own run's)."""
    rates = [run["machine"] for by_runner in results.values() for run in by_runner.values()
             if "machine" in run]  # fmt: skip
    if not rates:
        return "machine: no run finished"
    one = [r["one_thread"] for r in rates]
    every = [r["all_cores"] for r in rates]
    return (f"machine: torch sgemm fp32 {min(one):.0f}-{max(one):.0f} GFLOP/s on 1 thread, "
            f"{min(every):.0f}-{max(every):.0f} on {rates[0]['cores']} cores (each run measured "
            "its own, after its steps; floor s = the step's GFLOP at that all-core rate)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help=f"comma-separated, of {', '.join(SIZES)}")  # fmt: skip
    parser.add_argument("--steps", type=int, default=6, help="measured RL steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps left out")
    parser.add_argument("--skip-trl", action="store_true", help="miles alone (no TRL needed)")
    parser.add_argument("--log-dir", type=Path, help="each run's output (default: a new temp dir)")
    parser.add_argument("--json", type=Path, help="also write every run's results here")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"--sizes {','.join(unknown)} unknown; choose from {', '.join(SIZES)}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="miles_sweep_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, dict]] = {}
    for size in sizes:
        results[size] = {}
        for runner, flags in runners(args.skip_trl).items():
            log = log_dir / f"{size}_{runner.replace(' ', '_')}.log"
            results[size][runner] = run_cell(size, flags, args, log)

    print(f"\nworkload: e2e_vs_trl.py's defaults, {args.steps} measured steps after "
          f"{args.warmup} warm-up; seconds are medians per step")  # fmt: skip
    print(machine_line(results))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
