"""The `miles` command. Run `miles --help` for its subcommands."""

from miles.cli.main import main

__all__ = ["main"]
