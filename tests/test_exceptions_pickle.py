"""Every exception class of the project pickles: Ray carries an exception from the process that
raised it to the one that waits for it by pickling it, and one that cannot be rebuilt arrives as
Ray's UnserializableException, without its message. Each class is found by walking every miles
module, built from its own signature, and must come back with its type, message and attributes."""

from __future__ import annotations

import importlib
import inspect
import pickle
import typing
from pathlib import Path

import pytest

import miles

# Modules that cannot be imported here: they need a GPU stack or an optional engine.
_UNIMPORTABLE = ("sglang", "megatron", "apex", "transformer_engine", "flash_attn", "mlflow")


def _project_exceptions() -> list[type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # an optional stack this machine lacks, and only that
            if (err.name or "").split(".")[0] in _UNIMPORTABLE:
                continue
            raise
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


def _module_names() -> list[str]:
    """Every module of every miles wheel (a namespace package over all of them: pkgutil does not
    descend into namespace packages, so the files are walked)."""
    names = set()
    for root in map(Path, miles.__path__):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def _example(annotation: object, name: str) -> object:
    """A value of the parameter's type, distinct per parameter so a swap would show."""
    text = str(annotation)
    if "dict" in text:
        return {0: f"{name}-value"}
    if "int" in text and "str" not in text:
        return 7
    if "float" in text:
        return 1.5
    return f"{name}-value"


def _build(cls: type[BaseException]) -> BaseException:
    signature = inspect.signature(cls.__init__)
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that names a type only imported for checking
        hints = {}
    args, kwargs = [], {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        value = _example(hints.get(name, param.annotation), name)
        if param.kind == param.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    if not args and not kwargs:
        args = ["the message"]
    return cls(*args, **kwargs)


EXCEPTIONS = _project_exceptions()


def test_the_walk_finds_the_exceptions_that_cross_process_boundaries():
    names = {cls.__name__ for cls in EXCEPTIONS}
    assert {"EngineError", "EngineLostError", "TrainRankError", "RemoteRewardError",
            "SessionError", "DirectoryInUseError", "WeightSyncError"} <= names  # fmt: skip


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_project_exception_survives_a_pickle_round_trip(cls):
    error = _build(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error)
    assert back.args == error.args
    assert vars(back) == vars(error)
