"""--rollout-external-engine-addrs in the configuration: the addresses it takes, every setting it
refuses before start-up (naming the flag, its value and the fix), and a placement that reserves no
engine bundles."""

from __future__ import annotations

import pytest

from miles.config import load_config
from miles.config.engine_addresses import engine_url
from miles.config.placement_plan import plan_for_cluster, plan_placement

BASE = ["--hf-checkpoint", "ckpt", "--prompt-data", "train.jsonl", "--rollout-batch-size", "4"]
ADDRS = ["--rollout-external-engine-addrs", "127.0.0.1:30000", "engine-host:30001"]
GIVEN = r"--rollout-external-engine-addrs \(127\.0\.0\.1:30000 engine-host:30001\)"


def load(*flags: str, base: list[str] = BASE):
    return load_config([*base, *flags])


def test_addresses_become_the_engines_base_urls():
    config = load(*ADDRS, "--rollout-external-engine-addrs", "http://[::1]:30002")
    assert config.cluster.external_engine_urls == ["http://[::1]:30002"]  # the last flag wins
    config = load(*ADDRS)
    assert config.cluster.external_engine_urls == [
        "http://127.0.0.1:30000",
        "http://engine-host:30001",
    ]
    assert engine_url("https://engine-host:443/") == "https://engine-host:443"


@pytest.mark.parametrize(
    "addr", ["engine-host", "engine-host:port", "127.0.0.1:70000", "http://h:1/generate", ":80"]
)
def test_a_malformed_address_is_refused_naming_it(addr):
    with pytest.raises(ValueError) as caught:
        load("--rollout-external-engine-addrs", "127.0.0.1:30000", addr)
    message = str(caught.value)
    assert message.startswith(f"--rollout-external-engine-addrs: {addr!r} is not an engine")
    assert "e.g. 127.0.0.1:30000" in message


def test_an_engine_named_twice_is_refused():
    with pytest.raises(ValueError, match=r"names http://127\.0\.0\.1:30000 more than once"):
        load("--rollout-external-engine-addrs", "127.0.0.1:30000", "http://127.0.0.1:30000")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--colocate"], GIVEN + r" with --colocate: .* drop --colocate"),
        (["--rollout-num-gpus", "2"],
         r"--rollout-num-gpus \(2\) with " + GIVEN + ": the run reserves no devices .*; drop "
         "--rollout-num-gpus"),
        (["--rollout-num-gpus-per-engine", "2"],
         r"--rollout-num-gpus-per-engine \(2\) with " + GIVEN + ": .*; drop "
         "--rollout-num-gpus-per-engine"),
        (["--rollout-engine", "sglang"],
         r"--rollout-engine \(sglang\) with " + GIVEN + ": .*; drop --rollout-engine"),
        (["--engine-dtype", "bfloat16"],
         r"--engine-dtype \(bfloat16\) with " + GIVEN + ": .* launches none, so it would be "
         "ignored; drop --engine-dtype and set it on your engine servers instead"),
        (["--engine-max-running-requests", "8"], r"--engine-max-running-requests \(8\) with "),
        (["--engine-mem-fraction-static", "0.5"], r"--engine-mem-fraction-static \(0\.5\) with "),
        (["--engine-log-dir", "logs"], r"--engine-log-dir \(.*logs\) with "),
        (["--sglang-context-length", "64"],
         r"--sglang-server-args \(or --sglang-<flag>\) \(\['context-length=64'\]\) with "),
        (["--max-engine-restarts", "5"],
         r"--max-engine-restarts \(5\) with " + GIVEN + ": a lost external engine is never "
         "restarted .*; drop --max-engine-restarts"),
        (["--debug-train-only", "--load-debug-rollout-data", "r{rollout_id}.pt"],
         "--debug-train-only with " + GIVEN + ": it trains on saved rollouts .*; drop "
         "--rollout-external-engine-addrs"),
        (["--use-opd", "--opd-teacher-checkpoint", "{checkpoint}", "--opd-kl-coef", "0.5"],
         "--use-opd with " + GIVEN + ": it launches its teacher engines"),
        (["--return-routed-experts"],
         "--return-routed-experts / --use-rollout-routing-replay with " + GIVEN
         + ": it needs engines started with --enable-return-routed-experts"),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else None,
)  # fmt: skip
def test_settings_external_engines_cannot_honour_are_refused_before_start_up(
    flags, expected, tiny_checkpoint
):
    flags = [flag.replace("{checkpoint}", str(tiny_checkpoint)) for flag in flags]
    with pytest.raises(ValueError, match=expected):
        load(*ADDRS, *flags)


def test_adapter_sync_is_refused_for_engines_started_without_lora_serving(tiny_checkpoint):
    base = ["--hf-checkpoint", str(tiny_checkpoint), *BASE[2:]]
    flags = ["--lora-rank", "4", "--lora-sync", "adapter"]
    with pytest.raises(ValueError, match="--lora-sync adapter with " + GIVEN + ": .* use "
                       "--lora-sync merged"):  # fmt: skip
        load(*ADDRS, *flags, base=base)
    assert load(*ADDRS, "--lora-rank", "4", "--lora-sync", "merged", base=base)


def test_the_placement_plan_reserves_no_engine_bundles_for_external_engines():
    config = load(*ADDRS, "--actor-num-gpus-per-node", "2")
    assert config.cluster.rollout_num_gpus is None  # nothing derived for engines run elsewhere
    plan = plan_for_cluster(config.cluster, use_gpus=True)
    assert plan.engine_bundles == []
    assert plan.actor_bundles == [0, 1]
    assert plan.total_resources() == {"CPU": 2.0, "GPU": 2.0}
    launched = plan_for_cluster(load("--actor-num-gpus-per-node", "2").cluster, use_gpus=True)
    assert launched.engine_bundles == [[2]]  # the same run launching its engine takes one more


def test_the_placement_plan_refuses_engine_devices_beside_external_engines():
    with pytest.raises(ValueError, match="drop --colocate and --rollout-num-gpus"):
        plan_placement(actor_num_nodes=1, actor_num_gpus_per_node=1, rollout_num_gpus=1,
                       rollout_num_gpus_per_engine=1, colocate=False, use_gpus=False,
                       external_engines=True)  # fmt: skip
