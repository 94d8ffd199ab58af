"""The `tessera` command line. Each subcommand lives in tessera/commands/<name>.py and exposes
`register(subparsers)`; user errors exit non-zero with one line on stderr, never a traceback."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules under tessera.commands, in the order `tessera --help` lists them.
COMMAND_MODULES = ["generate", "adapters", "demo", "serve", "slo", "billing"]


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera multi-LoRA inference platform")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(f"tessera.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"tessera: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Under `python -m tessera.cli` this file runs as __main__; subcommands import tessera.cli,
    # so dispatch through that module for CLIError to be the same class they raise.
    from tessera.cli import main as _main

    sys.exit(_main())
