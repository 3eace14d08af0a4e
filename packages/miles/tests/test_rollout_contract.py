"""The rollout contract: what --rollout-function-path may name, the one adapter for functions of
the earlier signature, and a user's Rollout run by the built-in loop on a real engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles.backends.training_utils.batching.sample import Sample
from miles.backends.training_utils.infra.import_path import ImportPathError
from miles.rollout.context import RolloutOutput
from miles.rollout.contract import Rollout
from miles.rollout.engine_pool import EnginePool
from miles.rollout.loader import FunctionRollout, load_rollout
from miles.rollout.rollout_config import RolloutConfig
from miles.rollout.single_turn import SingleTurnRollout
from tests.support.rollout_context import rollout_context

DEFAULT = "miles.rollout.single_turn:SingleTurnRollout"


@pytest.fixture(autouse=True)
def custom_functions_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


class Prompts:
    """Groups of two fresh samples, one prompt each."""

    def __init__(self) -> None:
        self.served = 0

    def get_samples(self, num_prompts: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_prompts):
            g, self.served = self.served, self.served + 1
            tokens = list(f"Q{g}: hi".encode())
            groups.append([Sample(index=2 * g + i, group_index=g, tokens=tokens, prompt="")
                           for i in range(2)])  # fmt: skip
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise AssertionError("nothing is left over")


async def score_one(groups: list[list[Sample]]) -> None:
    for sample in (s for group in groups for s in group):
        sample.reward = 1.0


def _config(path: str, **fields) -> RolloutConfig:
    return RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, rollout_function_path=path,
                         rollout_max_response_len=4, **fields)  # fmt: skip


def test_a_users_rollout_class_by_path_runs_in_the_built_in_loop(engine_url):
    config = _config("custom_rollout_fns:TaggedRollout", rollout_temperature=0.5)
    rollout = load_rollout(config)
    assert type(rollout).__name__ == "TaggedRollout" and rollout.for_evaluation() is rollout

    async def run():
        async with EnginePool([engine_url]) as pool:
            ctx = rollout_context(pool, Prompts(), score_one, config)
            return await rollout.generate_rollout(ctx, 0)

    output = asyncio.run(run())
    assert [[s.group_index for s in g] for g in output.groups] == [[0, 0], [1, 1]]
    for sample in (s for group in output.groups for s in group):
        assert sample.metadata["made_at_temperature"] == 0.5 and sample.reward == 1.0
        assert 0 < sample.response_length <= 4
    assert output.metrics["rollout/submitted_groups"] == 2.0


def test_a_function_of_the_earlier_signature_is_adapted_in_one_place():
    sync = load_rollout(_config("custom_rollout_fns:sync_whole_rollout"))
    assert isinstance(sync, FunctionRollout) and not sync.makes_groups
    assert type(sync.for_evaluation()) is SingleTurnRollout
    ctx = rollout_context(
        None, Prompts(), score_one, _config("custom_rollout_fns:sync_whole_rollout")
    )
    output = asyncio.run(sync.generate_rollout(ctx, 7))
    assert output.metrics == {"mine/rollout": 7} and len(output.groups) == 1
    # An async function returning a bare list of groups: a RolloutOutput without metrics.
    bare = asyncio.run(
        load_rollout(_config("custom_rollout_fns:whole_rollout")).generate_rollout(ctx, 0)
    )
    assert isinstance(bare, RolloutOutput) and bare.metrics == {}
    assert [[s.group_index for s in g] for g in bare.groups] == [[1, 1]]
    with pytest.raises(TypeError, match=r"returned a dict; return a RolloutOutput or a list"):
        asyncio.run(
            load_rollout(_config("custom_rollout_fns:returns_a_dict")).generate_rollout(ctx, 0)
        )


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "custom_rollout_fns:Tagged",
            r"names the class Tagged, which is not a miles\.rollout\.contract\.Rollout",
        ),
        ("custom_rollout_fns:NOT_A_FUNCTION", r"names a int; point it at a Rollout subclass"),
        ("custom_rollout_fns:legacy_with_an_attribute", r"carries a `sample_generator` attribute"),
        ("custom_rollout_fns:no_such", r"has no attribute 'no_such'"),
    ],
)
def test_what_is_not_a_rollout_is_refused_naming_the_flag(path, message):
    with pytest.raises(ImportPathError, match=rf"--rollout-function-path .*{message}"):
        load_rollout(_config(path))


def test_a_rollout_without_generate_group_names_the_missing_method(monkeypatch):
    import custom_rollout_fns

    class Half(Rollout):
        pass

    monkeypatch.setattr(custom_rollout_fns, "Half", Half, raising=False)
    with pytest.raises(
        ImportPathError, match=r"Rollout Half, which does not define generate_group"
    ):
        load_rollout(_config("custom_rollout_fns:Half"))


def test_a_group_of_the_wrong_size_from_a_rollout_names_the_rollout():
    class NoEngines:  # the broken rollout never sends a request
        fault_tolerant, router_url = False, None

        async def abort_all(self) -> None:
            pass

    config = _config("custom_rollout_fns:DropsOne")
    ctx = rollout_context(NoEngines(), Prompts(), score_one, config)
    with pytest.raises(ValueError, match=r"DropsOne\.generate_group returned 1 samples .* has 2"):
        asyncio.run(load_rollout(config).generate_rollout(ctx, 0))


def test_the_custom_generate_flag_picks_the_per_sample_rollout_and_generate_sample_is_built_in():
    from miles.rollout.single_turn import CustomSampleRollout

    builtin = "miles.rollout.sample_generation:generate_sample"
    assert type(load_rollout(_config(DEFAULT, custom_generate_function_path=builtin))) is (
        SingleTurnRollout
    )
    canned = "custom_rollout_fns:canned_generate"
    made = load_rollout(_config(DEFAULT, custom_generate_function_path=canned))
    assert type(made) is CustomSampleRollout and made.generate_fn.__name__ == "canned_generate"
    by_path = "miles.rollout.single_turn:CustomSampleRollout"
    assert type(load_rollout(_config(by_path, custom_generate_function_path=canned))) is (
        CustomSampleRollout
    )
    with pytest.raises(ValueError, match="makes each sample with --custom-generate-function-path"):
        load_rollout(_config(by_path))
