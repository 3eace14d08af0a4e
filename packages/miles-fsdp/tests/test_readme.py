"""The README lists every FSDP setting, so the documentation cannot drift from FSDPArgs."""

from dataclasses import fields
from pathlib import Path

from miles.backends.fsdp_utils.arguments import FSDPArgs

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_every_fsdp_setting():
    text = README.read_text()
    missing = [f.name for f in fields(FSDPArgs) if f"`--{f.name.replace('_', '-')}`" not in text]
    assert not missing, f"README.md does not list: {missing}"
