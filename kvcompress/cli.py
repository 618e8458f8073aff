"""Command line: `kvcompress generate | compress | demo | calibrate | train-scorer | bench | eval` (also `python -m kvcompress`).

The top layer (docs/layout.md): this module only wires the subcommands together and runs the chosen
one; each lives in its own module with `add_cli(subparsers)` (`kvcompress.commands.*`, and
`kvcompress.demo`), their shared helpers in `kvcompress.commands.common`. Building the parser
imports neither torch nor transformers (a subcommand imports them when it runs), so `--help` and
argument errors answer at once. No library module imports from here.
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import sys

from .commands.common import ArgumentParser

_SUBCOMMAND_MODULES = ("kvcompress.commands.generate", "kvcompress.commands.compress", "kvcompress.demo", "kvcompress.commands.calibrate",
                       "kvcompress.commands.train_scorer", "kvcompress.commands.bench",
                       "kvcompress.commands.eval")


class _PrintVersion(argparse.Action):
    """`--version`: prints `kvcompress <version>` (the installed distribution's) and exits 0; the version is read only then."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        import kvcompress

        try:
            print(f"kvcompress {kvcompress.__version__}")
        except AttributeError as err:  # a source tree imported without being installed
            parser.exit(2, f"kvcompress: error: {err}\n")
        parser.exit()


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="kvcompress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=_PrintVersion)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    parser.subcommands = subparsers.choices  # name -> the subcommand's parser, which reports its own usage errors
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand and return its exit status; a usage error, or a bad input found when the command runs (ValueError,
    or a file that cannot be read/written, or an optional package not installed), is 2 with one line on stderr; Ctrl-C is
    130 with one line. Files are written in UTF-8 whatever the locale; what the terminal's encoding cannot show is
    printed as its escape."""
    for stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character (an ASCII locale) gets its escape
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # argparse would report them as the top-level command's: they are the subcommand's
            parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exit_:  # --help (0) or a usage error (2), already printed by argparse
        return exit_.code
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback, and how to go on where the command can
        hint = getattr(args, "on_interrupt", None)
        print(f"kvcompress {args.command}: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130
    except (ValueError, OSError) as err:
        print(f"kvcompress {args.command}: error: {as_flag(str(err), parser.subcommands[args.command])}", file=sys.stderr)
        return 2
    except ImportError as err:
        from .checks import MissingPackage  # here, not at the top: the parser runs without torch

        if not isinstance(err, MissingPackage):
            raise
        print(f"kvcompress {args.command}: error: {err}", file=sys.stderr)
        return 2


def as_flag(message: str, subparser: ArgumentParser) -> str:
    """A library error with the Python names of the command's parameters replaced by their flags, as the user typed them:
    a name that starts the message ("compression_ratio must be in [0, 1), got 1.5" -> "--compression-ratio must be in
    [0, 1), got 1.5"), a name given with its value anywhere ("use kv_bits='auto'" -> "use --kv-bits auto"), and a name with
    an underscore anywhere ("use compression_ratio <= 0.84" -> "use --compression-ratio <= 0.84") or before "unset"; a
    task's parameter as `SweepConfig` names it ("task_params['niah_multikey']['n_keys']") as --task-param gives it
    ("--task-param niah_multikey.n_keys"). Words no flag of the command has, and code in backticks, are left as they are."""
    flags = {action.dest: action.option_strings[-1] for action in subparser._actions
             if action.option_strings and action.option_strings[-1].startswith("--")}
    if "task_param" in flags:
        message = re.sub(r"task_params\['(\w+)'\]\['(\w+)'\]", rf"{flags['task_param']} \1.\2", message)
        message = re.sub(r"task_params\['(\w+)'\]", rf"{flags['task_param']} \1.NAME", message)

    def with_value(match: re.Match) -> str:
        value = match.group(3) if match.group(3) is not None else match.group(2)
        return flags[match.group(1)] if value == "True" else f"{flags[match.group(1)]} {value}"  # True: a switch given

    def bare(match: re.Match) -> str:
        name = match.group(1)
        named = match.start() == 0 or "_" in name or match.string.startswith(" unset", match.end())  # "leave mode unset"
        return flags[name] if name in flags and named else name

    def prose(text: str) -> str:
        text = re.sub(r"(?<![\w.'-])([a-z][a-z0-9_]*)=('([^'\s]*)'|[^\s,;)]+)",
                      lambda m: with_value(m) if m.group(1) in flags else m.group(0), text)
        return re.sub(r"(?<![\w.'-])([a-z][a-z0-9_]*)(?=[ (:<>,;.)]|$)", bare, text)

    # code the message quotes in backticks (a Python call it advises) stays as it is; a name followed by its flag in
    # parentheses ("max_new_tokens (--max-new-tokens)") is said once
    message = "`".join(prose(part) if i % 2 == 0 else part for i, part in enumerate(message.split("`")))
    return re.sub(r"(--[\w-]+) \(\1\)", r"\1", message)


if __name__ == "__main__":
    raise SystemExit(main())
