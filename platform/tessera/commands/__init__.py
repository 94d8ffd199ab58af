"""Subcommands of the `tessera` CLI."""
