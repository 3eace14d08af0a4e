"""Plugin lookup through real entry points of a distribution placed on sys.path by the test."""

import sys
import textwrap

import pytest

from miles.utils import plugins


@pytest.fixture
def installed_fake_backend(tmp_path, monkeypatch):
    """A real (tiny) installed distribution registering an `echo` train backend."""
    (tmp_path / "echo_backend.py").write_text("class EchoActor:\n    kind = 'echo'\n")
    dist_info = tmp_path / "echo_backend-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-backend\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        textwrap.dedent(
            f"""
            [{plugins.TRAIN_BACKENDS}]
            echo = echo_backend:EchoActor
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("echo_backend", None)


def test_installed_plugin_loads_the_registered_object(installed_fake_backend):
    assert "echo" in plugins.installed_plugins(plugins.TRAIN_BACKENDS)
    assert plugins.load_plugin(plugins.TRAIN_BACKENDS, "echo").kind == "echo"


def test_known_backend_without_its_wheel_names_the_wheel_to_install(monkeypatch):
    monkeypatch.setattr(plugins, "installed_plugins", lambda group: {})
    with pytest.raises(plugins.PluginNotInstalledError) as err:
        plugins.load_plugin(plugins.TRAIN_BACKENDS, "megatron")
    assert str(err.value) == (
        "--train-backend megatron needs the miles-megatron wheel, which is not installed: "
        "run `uv pip install miles-megatron`"
    )


def test_unknown_engine_suggests_the_closest_choice():
    with pytest.raises(
        ValueError,
        match=r"--rollout-engine 'referense' is not a known choice \(did you mean 'reference'\?\)",
    ):
        plugins.load_plugin(plugins.ROLLOUT_ENGINES, "referense")


def test_unknown_group_is_rejected():
    with pytest.raises(ValueError, match=r"unknown plugin group 'miles\.nope'"):
        plugins.load_plugin("miles.nope", "fsdp")
