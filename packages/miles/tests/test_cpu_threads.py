"""The torch threads of each process on a CPU-only run: the whole node for the processes of the
running phase where phases alternate, each process's own CPUs where they overlap, the user's
OMP_NUM_THREADS where it is set, torch's default on GPUs. Pure: no Ray."""

from __future__ import annotations

import pytest

from miles.config.placement_plan import plan_placement
from miles.ray.cpu_threads import cpu_threads_for_run, decide_cpu_threads, user_threads


def plan(*, ranks: int, engine_devices: int | None = None, colocate: bool = False, **more):
    return plan_placement(
        actor_num_nodes=1, actor_num_gpus_per_node=ranks, rollout_num_gpus=engine_devices,
        rollout_num_gpus_per_engine=1, colocate=colocate, use_gpus=False, **more,
    )  # fmt: skip


def test_alternating_phases_give_each_phase_the_whole_node():
    layout = plan(ranks=2, engine_devices=1)  # bundles: rank 0, rank 1, engine 0
    threads = decide_cpu_threads(layout, ["a"] * 3, {"a": 4}, phases_overlap=False)
    assert threads.train == (2, 2) and threads.engines == (4,)
    assert (
        threads.describe() == "cpu threads: train ranks 2 each, engines 4 each (phases alternate)"
    )


def test_colocated_ranks_and_engines_split_the_node_within_their_phase():
    layout = plan(ranks=4, colocate=True)
    threads = decide_cpu_threads(layout, ["a"] * 4, {"a": 8}, phases_overlap=False)
    assert threads.train == (2, 2, 2, 2) and threads.engines == (2, 2, 2, 2)


def test_each_node_is_shared_by_the_processes_placed_on_it():
    layout = plan(ranks=2, engine_devices=3)
    nodes = ["big", "big", "small", "small", "big"]  # engine 2 sits beside the train ranks
    threads = decide_cpu_threads(layout, nodes, {"big": 16, "small": 4}, phases_overlap=False)
    assert threads.train == (8, 8)
    assert threads.engines == (2, 2, 16)
    assert threads.describe().startswith("cpu threads: train ranks 8 each, engines 2-16 each")


def test_more_processes_than_cores_still_get_one_thread():
    threads = decide_cpu_threads(plan(ranks=3, engine_devices=1), ["a"] * 4, {"a": 2},
                                 phases_overlap=False)  # fmt: skip
    assert threads.train == (1, 1, 1) and threads.engines == (2,)


def test_a_critic_of_its_own_trains_with_the_policy_and_a_teacher_generates_with_the_engines():
    layout = plan(ranks=2, engine_devices=1, critic_ranks=2, teacher_engines=1)
    assert len(layout.bundles) == 6  # policy 0-1, engine 2, critic 3-4, teacher 5
    threads = decide_cpu_threads(layout, ["a"] * 6, {"a": 8}, phases_overlap=False)
    assert threads.train == (2, 2) and threads.critic == (2, 2)
    assert threads.engines == (4,) and threads.teachers == (4,)


@pytest.mark.parametrize(("cpus_per_bundle", "expected"), [(1.0, 1), (2.0, 2), (2.6, 3), (0.4, 1)])
def test_overlapping_phases_keep_each_process_to_its_bundles_cpus(cpus_per_bundle, expected):
    layout = plan(ranks=2, engine_devices=2, cpus_per_bundle=cpus_per_bundle)
    threads = decide_cpu_threads(layout, ["a"] * 4, {"a": 64}, phases_overlap=True)
    assert threads.train == (expected,) * 2 and threads.engines == (expected,) * 2
    assert threads.why == "phases overlap"


def test_the_users_omp_num_threads_is_kept_for_every_process():
    layout = plan(ranks=2, engine_devices=1)
    threads = cpu_threads_for_run(layout, ["a"] * 3, phases_overlap=False, has_gpus=False,
                                  environ={"OMP_NUM_THREADS": "3"})  # fmt: skip
    assert threads is not None and threads.train == (3, 3) and threads.engines == (3,)
    assert threads.describe() == (
        "cpu threads: train ranks 3 each, engines 3 each "
        "(OMP_NUM_THREADS=3 from the environment, kept)"
    )


def test_an_omp_num_threads_that_is_no_positive_integer_decides_nothing(caplog):
    assert user_threads(plan(ranks=1, engine_devices=1), "many") is None
    assert "OMP_NUM_THREADS='many' is no positive integer" in caplog.text


def test_gpu_runs_keep_torchs_default():
    layout = plan(ranks=1, engine_devices=1)
    assert cpu_threads_for_run(layout, ["a"] * 2, phases_overlap=False, has_gpus=True) is None
