"""`miles plot RUN_DIR`: PNG curves of a run's main metrics, read from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt

from miles.utils.tracking import METRICS_FILE, read_metrics

PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("rollout/reward_mean",),
    "eval": (),  # every eval/*/reward_mean and pass@k key found in the file
    "response_length": ("rollout/response_len_mean",),
    "loss": ("train/loss", "train/pg_loss"),
    "time": ("time/generate_s", "time/train_s", "time/update_weights_s"),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per panel that has data; returns the files written."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no {METRICS_FILE}; pass the --output-dir of a miles train run"
        )
    records = read_metrics(metrics_path)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    eval_keys = sorted(
        {
            k
            for r in records
            for k in r
            if k.startswith("eval/") and ("reward_mean" in k or "pass@" in k)
        }
    )
    written = []
    for panel, keys in PANELS.items():
        keys = tuple(eval_keys) if panel == "eval" else keys
        series = {key: _series(records, key) for key in keys}
        series = {key: points for key, points in series.items() if points}
        if not series:
            continue
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            xs, ys = zip(*points, strict=True)
            axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=key)
        axes.set_xlabel("rollout")
        axes.set_title(panel.replace("_", " "))
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        path = out / f"{panel}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    if not written:
        raise ValueError(f"{metrics_path} holds none of the plotted metrics yet")
    return written


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [
        (int(r["rollout_id"]), float(r[key]))
        for r in records
        if r.get(key) is not None and "rollout_id" in r
    ]
