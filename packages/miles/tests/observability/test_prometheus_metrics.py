"""The /metrics endpoint: real prometheus_client on a loopback port, scraped over HTTP; every
series is documented in the guide."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from miles.utils.observability.config import ObservabilityConfig
from miles.utils.observability.prometheus_metrics import SERIES, PrometheusEndpoint

GUIDE = Path(__file__).parents[4] / "docs" / "guides" / "observability.md"


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        name: float(value)
        for name, value in re.findall(r"^(miles_\w+) (\S+)$", text, flags=re.MULTILINE)
    }


def test_gauges_take_the_latest_record_and_counters_add_up(tmp_path):
    endpoint = PrometheusEndpoint(
        ObservabilityConfig(use_prometheus=True, prometheus_port=0), num_engines=2
    )
    try:
        assert endpoint.url.startswith("http://127.0.0.1:")  # loopback by default
        endpoint.log({"eval/reward_mean": 0.25}, step=-1)  # the evaluation before training
        first = {"rollout/reward_mean": 0.5, "rollout/samples": 8.0, "time/step_s": 2.0,
                 "rollout/response_tokens": 24.0, "engine/restarts": 1.0, "engine/serving": 1.0,
                 "reward/failures": 0.0, "time/update_weights_s": 0.3}  # fmt: skip
        endpoint.log(first, step=0)
        after_first = scrape(endpoint.url)
        second = {**first, "rollout/reward_mean": 0.75, "rollout/response_tokens": 16.0,
                  "engine/serving": 2.0, "reward/failures": 2.0, "train/loss": float("nan")}  # fmt: skip
        endpoint.log(second, step=1)
        after_second = scrape(endpoint.url)
    finally:
        endpoint.close()
    assert after_first["miles_rollout_id"] == 0 and after_second["miles_rollout_id"] == 1
    assert after_first["miles_reward_mean"] == 0.5 and after_second["miles_reward_mean"] == 0.75
    assert after_second["miles_eval_reward_mean"] == 0.25
    assert after_second["miles_rollouts_total"] == 2  # rollout -1 is no rollout
    assert (
        after_second["miles_samples_total"] == 16
        and after_second["miles_response_tokens_total"] == 40
    )
    # engine/restarts is a running total: a second record with 1 adds nothing.
    assert after_second["miles_engine_restarts_total"] == 1
    assert after_second["miles_reward_failures_total"] == 2
    assert after_first["miles_engines_serving"] == 1 and after_second["miles_engines_serving"] == 2
    assert after_second["miles_engines"] == 2
    assert after_second["miles_weight_sync_seconds"] == pytest.approx(0.3)
    with pytest.raises(OSError):  # closed: nothing listens any more
        urllib.request.urlopen(endpoint.url, timeout=5)


def test_a_taken_port_is_a_clear_error():
    first = PrometheusEndpoint(
        ObservabilityConfig(use_prometheus=True, prometheus_port=0), num_engines=1
    )
    try:
        port = int(first.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}.*pick a free"):
            PrometheusEndpoint(
                ObservabilityConfig(use_prometheus=True, prometheus_port=port), num_engines=1
            )
    finally:
        first.close()


def test_the_guide_documents_every_series_with_its_kind():
    guide = GUIDE.read_text()
    for series in SERIES:
        assert re.search(rf"`{series.name}`\s*\|\s*{series.kind}", guide), series.name
