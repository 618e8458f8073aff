"""Subcommands of the `kvcompress` command line (the top layer, with `kvcompress.cli`): argument parsing and checks, then a library call."""
