"""docs/guides/adding-a-backend.md: its package (entry points, settings, engine, actor) written
out as the page shows it, installed through its entry points, and checked against the contracts
it implements: the config loader, `TrainEngine` and `TrainRayActor.init` on one gloo rank."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import socket
import sys
import tomllib
from importlib.metadata import EntryPoint

import pytest
import torch.distributed as dist

from miles.backends.training_utils.algorithms.loss_config import LossConfig
from miles.backends.training_utils.step.train_engine import TrainEngine
from miles.backends.training_utils.step.trainer import PolicyTrainer
from miles.cli.main import main
from miles.config import load_config
from miles.config.registry import backend_config_class
from miles.train_backend import TrainRayActor, TrainRunSpec
from miles.utils import plugins
from tests.docs.guide import GUIDES, block, write_modules

GUIDE = "adding-a-backend.md"
MODULES = ("my_pkg/arguments.py", "my_pkg/engine.py", "my_pkg/actor.py")
REQUIRED = ["--hf-checkpoint", "c", "--prompt-data", "d.jsonl", "--rollout-batch-size", "2"]


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    """The guide's package importable, and its pyproject's entry points installed."""
    write_modules(GUIDE, list(MODULES), tmp_path)
    (tmp_path / "my_pkg/__init__.py").write_text('"""mybackend: a training backend of miles."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    tables = tomllib.loads(block(GUIDE, "pyproject.toml", language="toml"))
    ours = {
        group: [EntryPoint(name, value, group) for name, value in points.items()]
        for group, points in tables["project"]["entry-points"].items()
    }
    installed = plugins.entry_points
    monkeypatch.setattr(
        plugins, "entry_points", lambda group: [*installed(group=group), *ours.get(group, [])]
    )
    yield
    for name in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        del sys.modules[name]


def test_the_entry_points_name_the_guides_classes(my_pkg):
    from my_pkg.actor import MyTrainRayActor
    from my_pkg.arguments import MyArgs

    assert plugins.load_plugin(plugins.TRAIN_BACKENDS, "mybackend") is MyTrainRayActor
    assert backend_config_class("mybackend") is MyArgs
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info"]) == 0
    assert re.search(r"^train backends: .*\bmybackend\b", out.getvalue(), flags=re.MULTILINE)


def test_the_settings_are_flags_of_the_backend_only(my_pkg):
    from my_pkg.arguments import MyArgs

    flags = [*REQUIRED, "--actor-num-gpus-per-node", "2", "--train-backend", "mybackend"]
    config = load_config([*flags, "--shards-per-replica", "2"])
    assert isinstance(config.backend, MyArgs) and config.backend.shards_per_replica == 2
    assert config.model_parallel_size == 2  # read by the core: the rollout is split per replica

    with pytest.raises(ValueError, match="unknown setting '--shards-per-replica'"):
        load_config([*REQUIRED, "--shards-per-replica", "2"])  # the default backend, fsdp
    with pytest.raises(ValueError, match="--shards-per-replica must be >= 1, got 0"):
        load_config([*flags, "--shards-per-replica", "0"])
    with pytest.raises(ValueError, match="does not support --use-dynamic-batch-size"):
        load_config([*flags, "--shards-per-replica", "2", "--use-dynamic-batch-size",
                     "--max-tokens-per-gpu", "64"])  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple of the 3 ranks one model replica"):
        load_config([*flags, "--shards-per-replica", "3"])


def _protocol_members() -> set[str]:
    attributes = set(TrainEngine.__annotations__)
    methods = {n for n, v in vars(TrainEngine).items() if inspect.isfunction(v) and n[0] != "_"}
    return attributes | methods


def _signature(fn) -> tuple:
    sig = inspect.signature(fn)
    params = [(p.name, p.kind, p.default, p.annotation) for p in sig.parameters.values()]
    return params, sig.return_annotation


def test_the_guides_table_lists_every_member_of_train_engine():
    text = (GUIDES / GUIDE).read_text()
    section = text[text.index("## 3. The engine") : text.index("## 4. The actor")]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for cell in first_cells for name in re.findall(r"`(\w+)", cell)}
    assert listed == _protocol_members()


def test_the_engine_skeleton_has_every_member_with_the_protocols_signature(my_pkg):
    from my_pkg.engine import MyEngine

    methods = {n for n in _protocol_members() if callable(getattr(TrainEngine, n, None))}
    assert methods, "TrainEngine declares methods"
    for name in sorted(methods):
        assert _signature(getattr(MyEngine, name)) == _signature(getattr(TrainEngine, name)), name


def test_the_actor_implements_the_contract_with_the_builders_signature(my_pkg):
    from my_pkg.actor import MyTrainRayActor

    assert issubclass(MyTrainRayActor, TrainRayActor)
    assert not MyTrainRayActor.__abstractmethods__
    for name in ("build_engine", "check_supported"):
        got, _ = _signature(getattr(MyTrainRayActor, name))
        want, _ = _signature(getattr(TrainRayActor, name))
        # Names, kinds and defaults: a backend narrows the annotations to its own classes.
        assert [p[:3] for p in got] == [p[:3] for p in want], name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_builds_the_engine_and_the_step_on_one_gloo_rank(my_pkg, monkeypatch):
    from my_pkg.actor import MyTrainRayActor
    from my_pkg.arguments import MyArgs
    from my_pkg.engine import MyEngine

    monkeypatch.setenv("MILES_DEVICE", "cpu")
    spec = TrainRunSpec(hf_checkpoint="unused", rollout_temperature=1.0, global_batch_size=4,
                        num_rollout=3, num_steps_per_rollout=2)  # fmt: skip
    actor = MyTrainRayActor(0, 1, "127.0.0.1", _free_port())
    try:
        assert actor.init(spec, LossConfig(), MyArgs()) == 0  # a fresh run starts at rollout 0
        assert isinstance(actor.engine, MyEngine) and isinstance(actor.engine, TrainEngine)
        assert actor.engine.spec is spec and actor.engine.with_ref is False
        assert isinstance(actor.trainer, PolicyTrainer) and dist.get_backend() == "gloo"
        # A loss that reads the reference model's log-probs gets an engine with one.
        actor.init(spec, LossConfig(use_kl_loss=True, kl_loss_coef=0.1), MyArgs())
        assert actor.engine.with_ref is True
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
