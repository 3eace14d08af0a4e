"""`miles train` warns when every process would compile torch and transformers from source."""

from __future__ import annotations

import compileall
import json
import subprocess
import sys
from pathlib import Path

_REPORT = (
    "import json, sys; from miles.utils.bytecode import uncached_modules; "
    "print(json.dumps(uncached_modules(('heavy_pkg', 'light_mod', 'json'))))"
)


def _uncached(path: Path, *flags: str) -> list[str]:
    answer = subprocess.run(
        [sys.executable, *flags, "-c", _REPORT],
        env={"PYTHONPATH": str(path), "PATH": ""}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    return json.loads(answer.stdout)


def test_modules_without_bytecode_are_named_only_where_none_may_be_written(tmp_path: Path):
    (tmp_path / "heavy_pkg").mkdir()
    (tmp_path / "heavy_pkg" / "__init__.py").write_text("VALUE = 1\n")
    (tmp_path / "light_mod.py").write_text("VALUE = 2\n")
    # -B: as with PYTHONDONTWRITEBYTECODE; json is a built-in package with its bytecode.
    assert _uncached(tmp_path, "-B") == ["heavy_pkg", "light_mod"]
    assert _uncached(tmp_path) == [], "a Python that writes bytecode compiles each module once"
    assert compileall.compile_dir(tmp_path, quiet=1)
    assert _uncached(tmp_path, "-B") == []
