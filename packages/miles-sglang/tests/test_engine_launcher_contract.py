"""Every rollout engine registered under `miles.rollout_engines` implements the engine-launcher
contract (`engine_launcher.EngineLauncher`) over one `EngineLaunchSpec`."""

from importlib.metadata import entry_points

import pytest

from miles.backends.sglang_utils.engine_launcher import EngineLauncher, EngineLaunchSpec

REGISTERED = sorted(entry_points(group="miles.rollout_engines"), key=lambda ep: ep.name)


def test_the_built_in_engines_are_registered():
    assert {ep.name for ep in REGISTERED} >= {"reference", "sglang"}


@pytest.mark.parametrize("entry_point", REGISTERED, ids=lambda ep: ep.name)
def test_a_registered_launcher_is_an_engine_launcher_with_its_url_before_start(entry_point):
    launcher = entry_point.load()(EngineLaunchSpec(model_path="unused", port=30111))
    assert isinstance(launcher, EngineLauncher)
    assert launcher.url == "http://127.0.0.1:30111" and launcher.pid is None
    launcher.shutdown()  # never started: stopping is a no-op, not an error
