"""RolloutManager with --use-opd on real Ray: a teacher engine in a bundle of its own, beside the
student's; every sample of a rollout scored by it; `dispose()` stops it. The teacher here is the
student's own checkpoint, so its prompt log-probs must equal the log-probs the student's engine
sampled with (temperature 1): the teacher KL is 0 up to float error."""

from __future__ import annotations

import json

import httpx
import pytest
import ray

from miles.config import load_config
from miles.ray.cluster import init_ray
from miles.ray.placement import create_placement, plan_for_config, remove_placement
from miles.ray.rollout_manager import RolloutManager

GROUP = 2
PROMPTS = 4


@pytest.fixture(scope="module")
def manager(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("opd-run")
    prompts = out / "train.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"{a}+{a}=", "label": str(2 * a)}) + "\n"
                               for a in range(10)))  # fmt: skip
    config = load_config([
        "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(prompts),
        "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(GROUP),
        "--rollout-max-response-len", "6", "--rm-type", "exact_match",
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
        "--use-opd", "--opd-teacher-checkpoint", str(tiny_checkpoint), "--output-dir", str(out),
    ])  # fmt: skip
    init_ray(num_cpus=4)
    plan = plan_for_config(config, use_gpus=False)
    placement = create_placement(plan, timeout_s=60)
    actor = ray.remote(RolloutManager).options(num_cpus=0).remote(config, placement, dp_size=1)
    urls, _ = ray.get([actor.start_engines.remote(), actor.load_data.remote()], timeout=180)
    yield actor, urls, plan
    ray.get(actor.dispose.remote(), timeout=120)
    remove_placement(placement)
    ray.shutdown()


def test_the_teacher_runs_in_a_bundle_of_its_own(manager):
    actor, urls, plan = manager
    teachers = ray.get(actor.get_teacher_urls.remote())
    assert len(teachers) == 1 and teachers[0] not in urls
    assert plan.actor_bundles == [0] and plan.engine_bundles == [[1]]
    assert plan.teacher_bundles == [[2]]
    assert httpx.get(f"{teachers[0]}/health", timeout=30).status_code == 200


def test_every_sample_is_scored_and_a_teacher_equal_to_the_student_has_no_kl(manager):
    actor, *_ = manager
    result = ray.get(actor.generate.remote(0), timeout=120)
    (shard,) = ray.get(result["data"])
    assert len(shard["teacher_log_probs"]) == PROMPTS * GROUP
    for length, student, teacher in zip(
        shard["response_lengths"], shard["rollout_log_probs"], shard["teacher_log_probs"],
        strict=True,
    ):  # fmt: skip
        assert len(teacher) == length
        # The engine's prompt log-probs equal its sampling log-probs of the same tokens.
        assert teacher == pytest.approx(student, abs=1e-4)
    assert abs(result["metrics"]["opd/teacher_kl"]) < 1e-4


def test_dispose_stops_the_teacher(manager):
    actor, *_ = manager
    (teacher,) = ray.get(actor.get_teacher_urls.remote())
    ray.get(actor.dispose.remote(), timeout=120)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{teacher}/health", timeout=5)
    assert ray.get(actor.get_teacher_urls.remote()) == []
