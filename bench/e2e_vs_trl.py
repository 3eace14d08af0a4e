"""End to end GRPO, miles against TRL's `GRPOTrainer`: seconds per RL step on one workload.

Both run the same tiny Qwen3 checkpoint (built locally, byte-level tokenizer), the same prompts
(the CPU demo's max(a,b) task), samples per prompt, response length, learning rate, exact-match
reward (miles's own `exact_match` function on both sides) and temperature 1.0, with one optimizer
step per rollout and no reference model / KL. miles runs in-process on real Ray (one FSDP train
rank, one reference engine, disaggregated); TRL runs afterwards in the same process on CPU
(transformers `generate`, no vLLM). The script prints seconds per RL step of each (warm-up steps
excluded), the ratio, miles's time split (with the engine's own loop: prefill, decode and
sampling, from its `/get_server_info`) and both start-up times. It also prints each phase's
matmul FLOPs against torch's sgemm rate measured in the same run (`compute_floor.py`: how far a
step is from the machine's compute floor) and each process's peak resident memory.

TRL is installed only for the benchmark (it is no dependency of the workspace):

    uv run --frozen --with trl python bench/e2e_vs_trl.py [--steps 6] [--prompts 8] [--samples 8]

Checked with trl 1.16.0 on the locked transformers 5.24 (`--with trl` resolves it; pin it as
`--with trl==1.16.0` if a newer trl breaks). `--skip-trl` runs miles alone without it.

What differs between the two, by design of each framework (not of this script):
- miles runs generation and training in separate processes (engine + train actor) that take turns,
  and the one whose phase runs takes every core (`miles.ray.cpu_threads`: here the train rank and
  the engine each get all of the machine's cores, since the sync loop alternates; an exported
  OMP_NUM_THREADS overrides it); TRL runs both in this process. By default TRL gets one thread
  (`--trl-threads 1`); `--trl-threads 0` gives TRL torch's default (all cores), the same compute as
  miles, which on a busy machine mostly measures oversubscription (we saw 3-14 s per step on a
  loaded 2-core box). Runs before 2026-12-07 held miles to one thread per process too (Ray's
  OMP_NUM_THREADS=1 for a 1-CPU actor, inherited by the engine); export OMP_NUM_THREADS=1 to
  compare with them.
- With one optimizer step per rollout neither runs a separate old-policy forward: miles takes the
  old log-probs from the step's own forward (detached), TRL skips them when num_iterations == 1.
- miles trains on packed micro-batches of up to --max-tokens-per-gpu tokens (default here 4096: the
  whole rollout in one micro-batch). Its FSDP backend forwards each group's prompt once and the
  group's responses after it, on the prompt's KV cache (--share-prompt-forward, on by default):
  here 8 x 9 prompt tokens and 64 responses instead of 64 prompt-and-response rows. TRL pads each
  sample, prompt included, to the batch's longest one.
- miles pushes the new weights to the engine after every step (`time/update_weights_s`); TRL
  generates with the model it trains, so it has no weight sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compute_floor  # the sibling module that counts FLOPs and measures the machine
from process_memory import miles_processes, peak_rss_mb_of


def write_prompts(path: Path) -> list[dict[str, str]]:
    """Every ordered pair of distinct digits, "max(a,b)=" -> the larger one (90 rows)."""
    rows = [
        {"input": f"max({a},{b})=", "label": str(max(a, b))}
        for a, b in itertools.product(range(10), repeat=2)
        if a != b
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# -- miles ---------------------------------------------------------------------------------------


def run_miles(args: argparse.Namespace, checkpoint: Path, data: Path, out: Path) -> dict[str, Any]:
    import ray

    from miles.config import load_config
    from miles.ray.run import Run
    from miles.train import train_sync
    from miles.utils.tracking import read_metrics

    num_rollout = args.warmup + args.steps
    config = load_config([
        "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
        "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.samples),
        "--rollout-max-response-len", str(args.response_len), "--rollout-temperature", "1.0",
        "--num-rollout", str(num_rollout), "--num-steps-per-rollout", "1",
        "--rm-type", "exact_match", "--lr", str(args.lr),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu),
        "--output-dir", str(out), "--console", "plain", "--log-level", "WARNING",
        *args.miles_flag,
    ])  # fmt: skip
    begin = time.perf_counter()
    with Run(config) as run:
        started = time.perf_counter()
        loop_before = engine_loop_seconds(run.engine_urls)
        cpu_before = time.process_time()  # the driver's CPU, its threads included
        train_sync(run)
        driver_cpu_s = time.process_time() - cpu_before
        looped = time.perf_counter()
        loop_after = engine_loop_seconds(run.engine_urls)
        peak_rss_mb = {label: peak_rss_mb_of(pids) for label, pids in miles_processes(run).items()}
    closed = time.perf_counter()
    ray.shutdown()

    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "time/step_s" in r]
    measured = steps[args.warmup :]
    in_steps = sum(r["time/step_s"] for r in steps)

    def series(key: str) -> list[float]:
        return [float(r.get(key, 0.0)) for r in measured]

    step_s = series("time/step_s")
    generate = series("time/generate_s")
    manager = series("rollout/time_s")  # inside the rollout manager: generation + rewards + data
    engine = series("rollout/generate_time_s")  # requests to the engine (rewards overlap them)
    train = series("time/train_s")
    sync = series("time/update_weights_s")
    split = {
        "generate (driver view)": generate,
        "  engine requests + rewards": engine,
        "  train-data build in manager": [m - e for m, e in zip(manager, engine, strict=True)],
        "  Ray call + object transfer": [g - m for g, m in zip(generate, manager, strict=True)],
        "train (fwd/bwd + optim)": train,
        "weight sync": sync,
        "other (loop, logging, ...)": [
            s - g - t - w for s, g, t, w in zip(step_s, generate, train, sync, strict=True)
        ],
    }
    return {
        "step_s": summarize(step_s),
        "split_median_s": {k: statistics.median(v) for k, v in split.items()},
        # The engine's own loop, mean per rollout (warm-up included): what the engine did,
        # without HTTP, the rollout manager and rewards around it.
        "engine_loop_mean_s": {
            key: (loop_after[key] - loop_before[key]) / num_rollout for key in loop_after
        },
        "warmup_step_s": [r["time/step_s"] for r in steps[: args.warmup]],
        "startup_s": started - begin,  # Ray + placement + engine + train actor (+ model load)
        "initial_weight_sync_s": looped - started - in_steps,
        "teardown_s": closed - looped,
        "driver_cpu_per_rollout_s": driver_cpu_s / num_rollout,
        "response_len_mean": statistics.fmean(series("rollout/response_len_mean")),
        "reward_mean": statistics.fmean(series("rollout/reward_mean")),
        "peak_rss_mb": peak_rss_mb,
    }


def engine_loop_seconds(urls: list[str]) -> dict[str, float]:
    """The engines' `step_seconds` (prefill, decode and sampling forwards, whole loop steps),
    summed over engines, as `/get_server_info` reports them."""
    from miles.backends.sglang_utils.client import SyncEngineClient

    totals: dict[str, float] = {}
    for url in urls:
        with SyncEngineClient(url) as client:
            info = client.get_server_info()
        for key, seconds in info["internal_states"][0]["step_seconds"].items():
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


# -- TRL -----------------------------------------------------------------------------------------


def exact_match_reward(completions: list[str], label: list[str], **_: Any) -> list[float]:
    """The reward miles's `--rm-type exact_match` computes (no boxed answers in this task)."""
    from miles.rollout.rewards.text import exact_match

    return [exact_match(c, gold) for c, gold in zip(completions, label, strict=True)]


def run_trl(args: argparse.Namespace, checkpoint: Path, rows: list[dict], out: Path) -> dict:
    import datasets
    import torch
    import trl
    from transformers import TrainerCallback

    torch.manual_seed(0)
    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["input"], "label": r["label"]} for r in rows]
    )
    batch = args.prompts * args.samples
    config = trl.GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=batch,  # one optimizer step = one rollout
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.samples,
        num_iterations=1,
        gradient_checkpointing=False,  # TRL's default is True; miles's is off
        max_completion_length=args.response_len,
        temperature=1.0,
        beta=0.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_steps=args.warmup + args.steps,
        use_vllm=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs=None, **__: Any) -> None:
            self.logs.append(dict(logs or {}))

    timer = StepTimer()
    begin = time.perf_counter()
    trainer = trl.GRPOTrainer(
        model=str(checkpoint),
        reward_funcs=exact_match_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer],
    )
    built = time.perf_counter()
    phases = _time_trl_phases(trainer)
    trainer.train()

    # Consecutive step ends: everything of a step (data, generation, loss, optimizer, logging).
    step_s = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    measured = step_s[args.warmup :]
    split = {}
    if phases:
        for name, times in phases.items():
            split[name] = statistics.median(times[args.warmup :])
        generation = phases["generate + score (+ logprobs)"][args.warmup :]
        split["train (fwd/bwd + optim)"] = statistics.median(
            s - g for s, g in zip(measured, generation, strict=True)
        )
    lengths = [log["completions/mean_length"] for log in timer.logs if "completions/mean_length" in log]  # fmt: skip
    longest = [log["completions/max_length"] for log in timer.logs if "completions/max_length" in log]  # fmt: skip
    rewards = [log["reward"] for log in timer.logs if "reward" in log]
    return {
        "version": trl.__version__,
        "step_s": summarize(measured),
        "split_median_s": split,
        "warmup_step_s": step_s[: args.warmup],
        "startup_s": built - begin,
        "response_len_mean": statistics.fmean(lengths[args.warmup :]) if lengths else float("nan"),
        "reward_mean": statistics.fmean(rewards[args.warmup :]) if rewards else float("nan"),
        "response_len_max": statistics.fmean(longest[args.warmup :]) if longest else float("nan"),
        "torch_threads": torch.get_num_threads(),
        # This process: with miles run before it here, its driver's peak counts too.
        "peak_rss_mb": {"this process": peak_rss_mb_of([os.getpid()])},
    }


def _time_trl_phases(trainer: Any) -> dict[str, list[float]]:
    """Wrap the trainer's generation methods with timers (TRL logs its own profiling only to
    wandb / mlflow); empty when this TRL version names them differently."""
    names = {
        "generate + score (+ logprobs)": "_generate_and_score_completions",
        "  transformers generate": "_generate",
        "  rewards": "_calculate_rewards",
    }
    if not all(hasattr(trainer, method) for method in names.values()):
        return {}
    phases: dict[str, list[float]] = {name: [] for name in names}
    for name, method in names.items():
        original = getattr(trainer, method)

        def timed(*a: Any, _original=original, _times=phases[name], **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*a, **kw)
            finally:
                _times.append(time.perf_counter() - start)

        setattr(trainer, method, timed)
    return phases


# -- report --------------------------------------------------------------------------------------


def report(
    args: argparse.Namespace, workload: dict, machine: compute_floor.MachineRate,
    miles: dict | None, trl: dict | None,
) -> None:  # fmt: skip
    print()
    print(f"workload: {workload['model_info']}; {args.prompts} prompts x {args.samples} samples, "
          f"<= {args.response_len} response tokens, lr {args.lr}, 1 optimizer step per rollout; "
          f"{args.steps} measured steps after {args.warmup} warm-up")  # fmt: skip
    print(f"{'':34}{'median s/step':>14}{'mean':>9}{'min':>9}{'max':>9}{'resp len':>10}")
    for name, result in (("miles", miles), (f"TRL {trl['version'] if trl else ''}", trl)):
        if result is None:
            continue
        s = result["step_s"]
        print(f"{name:34}{s['median']:>14.3f}{s['mean']:>9.3f}{s['min']:>9.3f}{s['max']:>9.3f}"
              f"{result['response_len_mean']:>10.1f}")  # fmt: skip
    if miles and trl:
        ratio = miles["step_s"]["median"] / trl["step_s"]["median"]
        verdict = "slower" if ratio > 1 else "faster"
        print(f"ratio miles / TRL (median): {ratio:.2f}  (miles is {verdict})")
        generate_s = trl["split_median_s"].get("  transformers generate")
        if generate_s:  # tokens/s of this workload's generation, engine against `generate`
            engine = (
                miles["response_len_mean"] / miles["split_median_s"]["  engine requests + rewards"]
            )
            hf = trl["response_len_mean"] / generate_s
            print(
                f"generation tokens/s, reference engine / transformers generate: {engine / hf:.2f}x"
            )
            loop = miles["engine_loop_mean_s"].get("steps")
            if loop:  # the same ratio for the engine's loop alone (its mean over all rollouts)
                print(
                    f"  the engine's own loop alone ({loop:.3f} s a rollout) / generate: "
                    f"{generate_s / loop:.2f}x"
                )
    for name, result in (("miles", miles), ("TRL", trl)):
        if result is None or not result["split_median_s"]:
            continue
        print(f"\n{name} time split (median s per step):")
        for phase, seconds in result["split_median_s"].items():
            print(f"  {phase:36}{seconds:>8.3f}")
    if miles and miles["engine_loop_mean_s"]:
        loop = miles["engine_loop_mean_s"]
        print("\nmiles engine loop (s per rollout, mean; the rest of the engine requests is HTTP, "
              "the manager and rewards):")  # fmt: skip
        for key in ("prefill", "decode", "sampling", "steps"):
            print(f"  {key:36}{loop.get(key, 0.0):>8.3f}")
    print(f"\nmachine: torch sgemm (fp32, 2048^2, best of 5) {machine.one_thread:.0f} GFLOP/s on "
          f"1 thread, {machine.all_cores:.0f} on {machine.cores} cores, measured after the runs")  # fmt: skip
    if machine.all_cores < machine.one_thread:
        print("  (all cores slower than one: something else is running; the floor is loose)")
    for name, result in (("miles", miles), ("TRL", trl)):
        if result is not None:
            compute = result["compute"]
            print(compute_floor.format_floor(name, compute["phases"], compute["step"]))
    if miles:
        print(f"miles weight sync: {workload['param_bytes'] / 1e6:.1f} MB of parameters at "
              f"{miles['weight_sync_gb_per_s']:.2f} GB/s")  # fmt: skip
    print("\npeak resident memory (VmHWM, MB):")
    for name, result in (("miles", miles), ("TRL", trl)):
        if result is not None:
            peaks = ", ".join(f"{k} {v:.0f}" for k, v in result["peak_rss_mb"].items())
            print(f"  {name}: {peaks}")
    print("\nstart-up (one-off):")
    if miles:
        print(f"  miles: {miles['startup_s']:.1f} s (Ray + engine + train actor), initial weight "
              f"sync {miles['initial_weight_sync_s']:.2f} s, warm-up steps "
              f"{[round(x, 2) for x in miles['warmup_step_s']]}, teardown "
              f"{miles['teardown_s']:.1f} s")  # fmt: skip
    if trl:
        print(f"  TRL:   {trl['startup_s']:.1f} s (GRPOTrainer construction), warm-up steps "
              f"{[round(x, 2) for x in trl['warmup_step_s']]}, torch threads "
              f"{trl['torch_threads']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured RL steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps left out")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--response-len", type=int, default=16, help="max response tokens")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    parser.add_argument(
        "--miles-flag", action="append", default=[],
        help="extra `miles train` flag, repeatable (e.g. --miles-flag=--use-rollout-logprobs)",
    )  # fmt: skip
    parser.add_argument(
        "--trl-threads", type=int, default=1,
        help="torch threads for TRL: 1 (default) as each miles worker gets; 0: torch's default",
    )  # fmt: skip
    parser.add_argument("--skip-miles", action="store_true")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")

    from miles.backends.sglang_utils.tiny_checkpoint import build_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = build_tiny_checkpoint(
            root / "ckpt", seed=0, hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden_size // 4,
        )  # fmt: skip
        data = root / "prompts.jsonl"
        rows = write_prompts(data)
        workload = describe_workload(args, checkpoint, rows)
        miles = None if args.skip_miles else run_miles(args, checkpoint, data, root / "miles")
        trl = None if args.skip_trl else run_trl(args, checkpoint, rows, root / "trl")
    # After the runs (their processes gone), so that its matrices count in no peak memory.
    machine = compute_floor.measure_machine()
    add_compute_floor(args, workload, machine, miles, trl)
    report(args, workload, machine, miles, trl)
    if args.json:
        results = {"workload": workload, "machine": dataclasses.asdict(machine),
                   "miles": miles, "trl": trl}  # fmt: skip
        args.json.write_text(json.dumps(results, indent=2))


def describe_workload(args: argparse.Namespace, checkpoint: Path, rows: list[dict]) -> dict:
    """The model's size and shape and the prompts' mean length in tokens."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    weights = load_file(str(checkpoint / "model.safetensors")).values()
    params = sum(w.numel() for w in weights)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt_len = statistics.fmean(len(tokenizer(r["input"])["input_ids"]) for r in rows)
    config = json.loads((checkpoint / "config.json").read_text())
    return {
        "model_info": f"tiny Qwen3 {args.num_layers} layers, hidden {args.hidden_size}, "
        f"ffn {args.intermediate_size}, {params / 1e6:.2f} M params (fp32)",
        "params": params,
        "param_bytes": sum(w.numel() * w.element_size() for w in weights),
        "shape": dataclasses.asdict(compute_floor.ModelShape.from_config(config)),
        "prompt_len": prompt_len,
    }


def add_compute_floor(
    args: argparse.Namespace, workload: dict, machine: compute_floor.MachineRate,
    miles: dict | None, trl: dict | None,
) -> None:  # fmt: skip
    """Each result's `compute`: its phases' FLOPs and rates and the step against its floor, as
    each framework runs the workload (miles: packed rows, a group's prompt prefilled once by the
    engine and, with --share-prompt-forward, trained once; TRL: every row padded to the step's
    longest response, every prompt its own), and miles's weight-sync rate."""
    model = compute_floor.ModelShape(**workload["shape"])

    def rollout(response_len: float) -> compute_floor.RolloutShape:
        return compute_floor.RolloutShape(
            prompts=args.prompts, samples=args.samples, prompt_len=workload["prompt_len"],
            response_len=response_len,
        )  # fmt: skip

    if miles:
        packed = rollout(miles["response_len_mean"])
        share = "--no-share-prompt-forward" not in args.miles_flag
        phases = {
            "generation": (compute_floor.generation_flops(model, packed, share_prompt=True),
                           miles["split_median_s"]["generate (driver view)"]),
            "training": (compute_floor.training_flops(model, packed, share_prompt=share),
                         miles["split_median_s"]["train (fwd/bwd + optim)"]),
        }  # fmt: skip
        miles["compute"] = _compute(phases, miles["step_s"]["median"], machine)
        sync_s = miles["split_median_s"]["weight sync"]
        miles["weight_sync_gb_per_s"] = workload["param_bytes"] / 1e9 / sync_s
    if trl:
        longest = trl["response_len_max"]  # TRL logs it; the limit where it did not
        padded = rollout(args.response_len if math.isnan(longest) else longest)
        split = trl["split_median_s"]
        phases = {
            "generation": (compute_floor.generation_flops(model, padded, share_prompt=False),
                           split.get("generate + score (+ logprobs)", float("nan"))),
            "training": (compute_floor.training_flops(model, padded, share_prompt=False),
                         split.get("train (fwd/bwd + optim)", float("nan"))),
        }  # fmt: skip
        trl["compute"] = _compute(phases, trl["step_s"]["median"], machine)


def _compute(phases: dict[str, tuple[float, float]], step_s: float, machine: Any) -> dict:
    return {
        "phases": {
            name: compute_floor.phase_rate(flops, seconds, machine)
            for name, (flops, seconds) in phases.items()
        },
        "step": compute_floor.step_floor(sum(f for f, _ in phases.values()), step_s, machine),
    }


if __name__ == "__main__":
    main()
