"""load_function: both path spellings load, and every failure names the flag and what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.backends.training_utils.infra.import_path import (
    ImportPathError,
    load_function,
    split_import_path,
)

FLAG = "--some-function-path"


@pytest.fixture(autouse=True)
def helper_modules_importable(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    (tmp_path / "broken_rollout_module.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    "path", ["custom_rollout_fns:keep_odd_groups", "custom_rollout_fns.keep_odd_groups"]
)
def test_colon_and_dot_spellings_load_the_same_function(path):
    import custom_rollout_fns

    assert load_function(path, FLAG) is custom_rollout_fns.keep_odd_groups


def test_a_dotted_attribute_after_the_colon_is_followed():
    assert load_function("pathlib:Path.cwd", FLAG) == Path.cwd


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", r"'' is not an import path; write 'package.module:function'"),
        ("justaname", r"'justaname' is not an import path"),
        ("mod:", r"'mod:' is not an import path"),
        (":fn", r"':fn' is not an import path"),
        ("mod:not-an-identifier", r"is not an import path"),
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'; check the spelling"),
        (
            "needs_missing_dep:fn",
            r"cannot import module 'needs_missing_dep' \(it imports 'no_such_dependency_xyz'",
        ),
        (
            "broken_rollout_module:fn",
            r"importing module 'broken_rollout_module' failed with RuntimeError: boom at import",
        ),
        (
            "custom_rollout_fns:keep_odd_group",
            r"'custom_rollout_fns' has no attribute 'keep_odd_group' \(did you mean "
            r"'keep_odd_groups'\?\)",
        ),
        ("custom_rollout_fns:NOT_A_FUNCTION", r"names a int, not a function"),
    ],
)
def test_errors_name_the_flag_the_path_and_the_fix(path, message):
    with pytest.raises(ImportPathError, match=rf"^{FLAG} .*{message}"):
        load_function(path, FLAG)


def test_path_errors_are_value_errors_too():
    """Config validation raises ValueError; a malformed path is a bad flag value like any other."""
    with pytest.raises(ValueError):
        split_import_path("nodots", FLAG)
