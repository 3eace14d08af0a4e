"""The configuration reference, rendered from the schema so it cannot drift from the code.

`render_reference()` is what the README section and `docs/configuration.md` hold; a test fails when
either is stale, and `python -m miles.config.docs --write FILE...` refreshes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from miles.config.options import Option
from miles.config.registry import BACKEND_GROUP, Schema

BEGIN = "<!-- BEGIN GENERATED CONFIG REFERENCE (python -m miles.config.docs --write) -->"
END = "<!-- END GENERATED CONFIG REFERENCE -->"


def render_reference(schema: Schema, heading: str = "###") -> str:
    """Markdown: one table per group (flag, type, default, meaning), in `--help` order."""
    lines: list[str] = []
    for group, cls in schema.groups.items():
        options = [o for o in schema.options.values() if o.groups[0] == group]
        title = f"{group} ({cls.__name__})" if group == BACKEND_GROUP else group
        lines += [f"{heading} {title}", ""]
        doc = " ".join((cls.__doc__ or "").split())
        if doc:
            lines += [doc, ""]
        lines += ["| flag | type | default | meaning |", "|---|---|---|---|"]
        lines += [_row(o) for o in options]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _row(option: Option) -> str:
    default = "**required**" if option.required else f"`{option.default}`"
    shared = f" Also configures: {', '.join(option.groups[1:])}." if option.groups[1:] else ""
    cell = (option.doc + shared).replace("|", "\\|")
    return f"| `{option.flag}` | `{option.type_name}` | {default} | {cell} |".replace("`|", "`\\|")


def splice(text: str, reference: str) -> str:
    """`text` with the part between the BEGIN and END markers replaced by `reference`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no generated-reference markers in the file; add {BEGIN} and {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{reference}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", nargs="+", metavar="FILE", help="refresh these files")
    parser.add_argument("--train-backend", default="fsdp")
    args = parser.parse_args(argv)
    reference = render_reference(Schema.for_backend(args.train_backend))
    if not args.write:
        sys.stdout.write(reference)
        return 0
    for path in map(Path, args.write):
        path.write_text(splice(path.read_text(), reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
