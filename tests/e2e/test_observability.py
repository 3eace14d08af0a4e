"""Observability end to end: one short run with every flag on, and its resume, feed every check.

The run (real Ray, FSDP on two gloo ranks, one reference engine, held-out evaluation) logs to
MLflow's embedded store, serves /metrics (scraped while it runs), profiles rollout 1 on the train
ranks, the rollout manager and the engine, and records memory. It is then resumed for one more
rollout, which must continue the same MLflow run. The report of the run directory is opened in
a real headless Chromium.
"""

from __future__ import annotations

import gzip
import json
import re
import socket
import threading
import urllib.request

import pytest
import ray
from mlflow import MlflowClient

from miles.utils.observability.memory_record import read_record
from miles.utils.observability.mlflow_tracking import MlflowRunRef
from miles.utils.observability.prometheus_metrics import SERIES
from miles.utils.observability.report_html import SECTIONS, write_report
from miles.utils.tracking import read_metrics
from tests.e2e.assets import tiny_run_assets
from tests.e2e.test_train_loop import tiny_config
from tests.support.headless_chromium import chromium_path, load_page

pytestmark = pytest.mark.timeout(900)

PROCESSES = {"driver", "rollout_manager", "train_rank_0", "train_rank_1", "engine_0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Scraper:
    """GETs /metrics every 0.2 s in a thread while a run goes on; keeps every distinct answer."""

    def __init__(self, url: str) -> None:
        self.url, self.answers = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                text = urllib.request.urlopen(self.url, timeout=5).read().decode()
            except OSError:  # not serving yet, or no more
                continue
            if not self.answers or self.answers[-1] != text:
                self.answers.append(text)


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """(output dir, /metrics answers during the first run, its records, the resumed records)."""
    root = tmp_path_factory.mktemp("observed")
    assets = tiny_run_assets(root / "assets")
    out, port = root / "run", free_port()
    flags = [
        "--rollout-num-gpus", "1", "--save", str(root / "ckpt"), "--save-interval", "1",
        "--eval-prompt-data", "heldout", str(assets[1]), "--eval-interval", "1",
        "--use-mlflow", "--mlflow-tags", "suite=e2e",
        "--use-prometheus", "--prometheus-port", str(port),
        "--profile-target", "train", "rollout-manager", "engine",
        "--profile-step-start", "1", "--profile-step-end", "2",
        "--memory-snapshot-dir", str(out / "memory"),
    ]  # fmt: skip
    from miles.train import train

    with Scraper(f"http://127.0.0.1:{port}/metrics") as scraper:
        train(tiny_config(assets, out, *flags, "--num-rollout", "2"))
    first = read_metrics(out / "metrics.jsonl")
    train(tiny_config(assets, out, *flags, "--num-rollout", "3"))  # resumes at rollout 2
    yield out, scraper.answers, first, read_metrics(out / "metrics.jsonl")
    if ray.is_initialized():
        ray.shutdown()


def test_mlflow_holds_params_metrics_and_artifacts_and_the_resumed_run_continues_it(observed):
    out, _, first, resumed = observed
    assert [r["rollout_id"] for r in first] == [-1, 0, 1]
    assert [r["rollout_id"] for r in resumed] == [-1, 0, 1, 2]
    ref = MlflowRunRef.read(out)
    client = MlflowClient(tracking_uri=ref.tracking_uri)
    assert ref.tracking_uri.startswith("sqlite:///") and str(out) in ref.tracking_uri
    (run,) = client.search_runs([ref.experiment_id])  # the resume made no second run
    assert run.info.run_id == ref.run_id and run.info.status == "FINISHED"
    config = json.loads((out / "config.json").read_text())
    params = run.data.params
    assert params["rollout_batch_size"] == "4" and params["use_mlflow"] == "true"
    assert set(config) <= set(params)  # the whole resolved config
    assert run.data.tags["suite"] == "e2e"
    assert run.data.tags["miles.changed_on_resume.num_rollout"] == "2 -> 3"
    rewards = client.get_metric_history(ref.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in rewards) == [0, 1, 2]
    by_step = {m.step: m.value for m in rewards}
    assert by_step == {r["rollout_id"]: r["rollout/reward_mean"] for r in resumed[1:]}
    assert client.get_metric_history(ref.run_id, "eval/heldout/pass_at_1")[0].step == -1
    plots = {a.path for a in client.list_artifacts(ref.run_id, "plots")}
    assert {"plots/reward.png", "plots/time.png"} <= plots
    assert "config.json" in {a.path for a in client.list_artifacts(ref.run_id)}


def test_metrics_endpoint_served_the_documented_names_with_moving_values(observed):
    _, answers, first, _ = observed
    assert answers, "/metrics never answered during the run"
    last = answers[-1]
    for series in SERIES:
        assert f"# HELP {series.name} {series.help}" in last, series.name
        assert f"# TYPE {series.name} {series.kind}" in last, series.name

    def value(text: str, name: str) -> float | None:
        found = re.search(rf"^{name} (\S+)$", text, flags=re.MULTILINE)
        return float(found.group(1)) if found else None

    rollout_ids = [value(a, "miles_rollout_id") for a in answers]
    assert [-1.0, 0.0, 1.0] == sorted({r for r in rollout_ids if r is not None})
    samples = [value(a, "miles_samples_total") for a in answers]
    assert samples[-1] == 16.0 and len(set(samples)) >= 3  # 0, 8, 16: it moved while we watched
    tokens = sum(r["rollout/response_tokens"] for r in first if r["rollout_id"] >= 0)
    assert value(last, "miles_response_tokens_total") == tokens
    assert value(last, "miles_engines") == 1.0 and value(last, "miles_engines_serving") == 1.0
    assert value(last, "miles_step_seconds") == pytest.approx(first[-1]["time/step_s"])


def test_the_profiled_rollout_left_a_trace_of_every_target(observed):
    out, _, _, _ = observed
    profiles = out / "profiles"
    # Train ranks: torch.profiler's Chrome trace, with the step's backward in it.
    for rank in (0, 1):
        trace = json.loads(
            (profiles / "train" / f"rank_{rank}.rollouts_1-1.pt.trace.json").read_text()
        )
        events = trace["traceEvents"]
        assert all({"ph", "name"} <= set(e) for e in events)
        names = {e["name"] for e in events}
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    # The rollout manager: py-spy's Chrome trace of its Python stacks.
    manager = json.loads((profiles / "rollout_manager" / "rollouts_1-1.json").read_text())
    assert manager and all({"ph", "ts", "name", "pid", "tid"} <= set(e) for e in manager)
    # One process sampled: a Ray worker (its main loop is Ray's default_worker.py). Which of
    # the manager's coroutines show depends on what runs at a sample's instant (a tiny
    # rollout's generation takes milliseconds), so this checks the process, not the frames.
    assert len({e["pid"] for e in manager}) == 1
    files = {e.get("args", {}).get("filename", "") for e in manager}
    assert any(f.endswith("ray/_private/workers/default_worker.py") for f in files), sorted(files)
    # The engine: its own profiler's trace, as SGLang names it, with the model's ops.
    (engine,) = (profiles / "engines" / "engine_0").glob("*-TP-0.trace.json.gz")
    engine_events = json.loads(gzip.decompress(engine.read_bytes()))["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in engine_events)


def test_the_memory_record_shows_each_process_peak_per_phase(observed):
    out, _, _, resumed = observed
    lines = read_record(out / "memory")
    assert {line["process"] for line in lines} == PROCESSES
    loop = {"generate", "train", "save", "update_weights", "eval"}
    for rollout_id in (0, 1, 2):
        for process in PROCESSES:
            phases = {x["phase"] for x in lines
                      if x["rollout_id"] == rollout_id and x["process"] == process}  # fmt: skip
            # Every phase has a window, however short; start-up comes with each run's first.
            expected = loop | ({"startup", "initial_weight_update"} if rollout_id != 1 else set())
            assert phases == expected, (rollout_id, process, phases)
    for line in lines:
        assert line["peak_rss_mb"] > 10, line  # every one a live Python process
    for record in resumed[1:]:
        for process in PROCESSES:
            peaks = [x["peak_rss_mb"] for x in lines
                     if x["rollout_id"] == record["rollout_id"] and x["process"] == process]  # fmt: skip
            assert record[f"memory/{process}/peak_rss_mb"] == max(peaks)


@pytest.mark.skipif(
    chromium_path() is None,
    reason="no Chromium on $PATH: `.ci/run` installs Debian's chromium where apt-get can "
    "(run it as root, or `apt-get install chromium`)",
)
def test_the_report_renders_every_section_in_headless_chromium(observed, tmp_path):
    out, _, _, _ = observed
    report = write_report(out, tmp_path / "report.html")
    check = """JSON.stringify({
        sections: [...document.querySelectorAll('section')].map(s => ({
            id: s.id, height: s.getBoundingClientRect().height,
            rows: s.querySelectorAll('tbody tr').length, empty: !!s.querySelector('.empty')})),
        images: [...document.images].map(i => i.complete && i.naturalWidth > 0),
        external: [...document.querySelectorAll('[src]')].filter(
            e => !e.getAttribute('src').startsWith('data:')).length,
        overflow: document.documentElement.scrollWidth - window.innerWidth})"""
    page = load_page(report.as_uri(), check)
    assert page.errors == []
    found = json.loads(page.value)
    assert [s["id"] for s in found["sections"]] == [key for key, _ in SECTIONS]
    assert all(s["height"] > 0 for s in found["sections"])
    sections = {s["id"]: s for s in found["sections"]}
    for key in ("config", "time-split", "startup", "memory", "evaluation"):
        assert sections[key]["rows"] > 0 and not sections[key]["empty"], key
    assert len(found["images"]) >= 4 and all(found["images"])  # the curves, decoded
    assert found["external"] == 0  # self-contained
    assert found["overflow"] <= 0  # wide tables scroll in their section, the page does not
