"""The lint check that catches a package importing a sibling wheel it does not declare."""

import subprocess
import sys

from tools.check_sibling_imports import find_violations
from tools.workspace import REPO_ROOT

CHECK = [sys.executable, str(REPO_ROOT / "tools" / "check_sibling_imports.py")]


def test_repository_declares_every_sibling_it_imports():
    assert find_violations(REPO_ROOT) == []


def test_lint_fails_when_training_utils_imports_an_undeclared_sibling(workspace_copy):
    module = (
        workspace_copy / "packages/miles-training-utils/src/miles/backends/training_utils/leak.py"
    )
    module.write_text('"""Reaches up a layer."""\n\nfrom miles.backends.fsdp_utils import x\n')
    result = subprocess.run([*CHECK, "--root", str(workspace_copy)], capture_output=True, text=True)
    assert result.returncode == 1
    assert (
        "leak.py:3: miles-training-utils imports miles.backends.fsdp_utils.x from miles-fsdp "
        "without declaring it"
    ) in result.stderr


def test_transitive_only_dependency_is_not_enough(workspace_copy):
    # miles-fsdp reaches training-utils through miles too; the import still needs its own pin.
    pyproject = workspace_copy / "packages/miles-fsdp/pyproject.toml"
    text = pyproject.read_text().replace('    "miles-training-utils==0.1.0",\n', "", 1)
    pyproject.write_text(
        text.replace('"miles-training-utils[cuda]==0.1.0", ', "")
        .replace('"miles-training-utils[rocm]==0.1.0", ', "")
        .replace('"miles-training-utils[npu]==0.1.0", ', "")
    )
    module = workspace_copy / "packages/miles-fsdp/src/miles/backends/fsdp_utils/uses_device.py"
    module.write_text("import miles.backends.training_utils.infra.device\n")
    violations = find_violations(workspace_copy)
    assert any(
        "uses_device.py:1: miles-fsdp imports miles.backends.training_utils.infra.device" in v
        for v in violations
    )
    assert all("from miles-training-utils without declaring it" in v for v in violations)


def test_import_of_a_module_no_package_owns_is_reported(workspace_copy):
    module = workspace_copy / "packages/miles/src/miles/utils/ghost.py"
    module.write_text("from miles.nowhere import thing\n")
    assert any(
        "miles.nowhere.thing, which no package owns" in v for v in find_violations(workspace_copy)
    )
