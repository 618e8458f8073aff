"""Start-up time of the command line: `--help` and an argument error, each in a fresh process.

Each command runs `--runs` times in a subprocess (interleaved, so a load change of a shared
machine hits all of them); the median and min wall-clock seconds are printed, after one line
describing the machine. `python -c pass` is the floor of any Python process, and
`python -c "import torch"` what a command pays once it imports torch.

    .venv/bin/python benchmarks/cli_startup.py --runs 10
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def commands() -> dict[str, tuple[list[str], int, str]]:
    """{label: (argv, expected exit status, text expected in its output)}: a command that does not do what
    it should (e.g. `python -m` of a module without a main block prints nothing) fails the run."""
    python = sys.executable
    script = shutil.which("kvcompress", path=str(Path(python).parent))  # the console script next to this Python
    usage, error = (0, "usage: kvcompress"), (2, "error:")
    out = {
        "python -c pass": ([python, "-c", "pass"], 0, ""),
        "python -c 'import torch'": ([python, "-c", "import torch"], 0, ""),
        "python -m kvcompress --help": ([python, "-m", "kvcompress", "--help"], *usage),
        "python -m kvcompress.cli --help": ([python, "-m", "kvcompress.cli", "--help"], *usage),
        "python -m kvcompress.cli generate --help": ([python, "-m", "kvcompress.cli", "generate", "--help"], *usage),
        "python -m kvcompress.cli generate --budget many (argument error)": (
            [python, "-m", "kvcompress.cli", "generate", "--context-file", "x", "--budget", "many"], *error),
        "python -m kvcompress.cli bench --sections speed (argument error)": (
            [python, "-m", "kvcompress.cli", "bench", "--sections", "speed"], *error),
    }
    if script is not None:
        out["kvcompress --help"] = ([script, "--help"], *usage)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per command (default 10)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    import torch

    from kvcompress.eval.bench import machine_description

    print(f"Machine: {machine_description(torch.get_num_threads())}.")
    cmds = commands()
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(args.runs):
        for label, (cmd, status, expected) in cmds.items():
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            times[label].append(time.perf_counter() - start)
            if done.returncode != status or expected not in done.stdout + done.stderr:
                raise SystemExit(f"`{label}` exited {done.returncode} (expected {status}, with {expected!r} in its output):\n{done.stdout}{done.stderr}")
    print(f"\n{args.runs} runs each, wall-clock seconds\n")
    print("| command | median s | min s |\n|---|---|---|")
    for label, t in times.items():
        print(f"| `{label}` | {statistics.median(t):.3f} | {min(t):.3f} |")


if __name__ == "__main__":
    main()
