"""CODEOWNERS rules: catch-all first, every package owned, nothing shadowed, no dead paths."""

from tools.check_codeowners import check
from tools.workspace import REPO_ROOT


def _write(root, text):
    (root / "CODEOWNERS").write_text(text)
    return check(root)


def test_repository_codeowners_passes():
    assert check(REPO_ROOT) == []


def test_broader_rule_after_a_narrower_one_is_reported_as_shadowing(workspace_copy):
    text = (REPO_ROOT / "CODEOWNERS").read_text() + "/packages/ @miles-project/everyone\n"
    problems = _write(workspace_copy, text)
    assert any("/packages/miles-fsdp/ is shadowed by the broader /packages/" in p for p in problems)


def test_catch_all_must_come_first(workspace_copy):
    lines = (REPO_ROOT / "CODEOWNERS").read_text().splitlines()
    catch_all = next(line for line in lines if line.startswith("*"))
    reordered = [line for line in lines if line != catch_all] + [catch_all]
    problems = _write(workspace_copy, "\n".join(reordered) + "\n")
    assert any("first rule must be the catch-all" in p for p in problems)
    assert any("shadowed by the broader *" in p for p in problems)


def test_package_without_owner_and_missing_path_are_reported(workspace_copy):
    text = (
        (REPO_ROOT / "CODEOWNERS")
        .read_text()
        .replace("/packages/miles-megatron/", "/packages/miles-megatorn/")
    )
    problems = _write(workspace_copy, text)
    assert any("/packages/miles-megatorn/ names a path that does not exist" in p for p in problems)
    assert any("package miles-megatron has no owner line" in p for p in problems)


def test_glob_patterns_are_refused_with_the_supported_forms(workspace_copy):
    problems = _write(workspace_copy, "* @org/all\n*.py @org/python\n")
    assert any("'*.py' is neither '*' nor an anchored path" in p for p in problems)
