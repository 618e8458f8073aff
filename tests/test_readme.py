"""Every example of the README, run as printed and checked against what the README shows it prints.

The snippets are read from README.md itself, so editing an example changes what is run. In a snippet,
lines starting with `# ` (or a lone `#`) at the start of a line are printed output:
- Python snippets: the snippet's whole stdout must equal those lines, in order;
- shell snippets: the lines shown after a command must appear, in order, in what that command prints
  (shown lines are an excerpt of longer outputs).
Times (`1.23s`, with the spaces before them) are masked on both sides, and a figure with a decimal point
matches one within a relative 1e-4 of it (`same_line`): the last digits of a float reduction depend on the
host's kernels and thread count; the words, integers and the figures' places must match exactly. Every fenced snippet is claimed by exactly one test below
(`test_every_readme_snippet_is_run_by_a_test`); the install-only one is listed in INSTALL_ONLY.
Model-loading runs are `smoke` (CI) where they are quick, `e2e` otherwise; pure-tensor ones are unit tests.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TEXT = README.read_text(encoding="utf-8")
TIME = re.compile(r" *\b\d+(\.\d+)?s\b")  # a right-aligned column of times masks alike at any width

# Which test runs which fenced snippet: a string found in exactly one snippet.
PY_FIRST = 'cache = kvc.CompressedCache(model, "keydiff", compression_ratio=0.5)   # also selects'
PY_PIPELINE = 'pipeline("kvcompress-text-generation"'
PY_BATCH = 'tokenizer.padding_side = "left"'
PY_REPORT = "print(res.report())"
PY_TENSOR = 'kvc.stream("express", budget=512)'
SH_CLI = "kvcompress generate --method keydiff"
SH_DEMO = "kvcompress demo"
SH_SAVED = "kvcompress compress --context-file"
SH_BENCHMARKS = "kvcompress eval --benchmark longbench"
SH_PERPLEXITY = "kvcompress eval --tasks perplexity"
SH_RULER_GPU = "git clone https://github.com/NVIDIA/RULER"
INSTALL_ONLY = ["make demo", "make test"]  # sets up .venv and runs the tests; `kvcompress demo` is run below (SH_DEMO)
CLAIMED = [PY_FIRST, PY_PIPELINE, PY_BATCH, PY_REPORT, PY_TENSOR, SH_CLI, SH_DEMO, SH_SAVED, SH_BENCHMARKS, SH_PERPLEXITY, SH_RULER_GPU]


def snippets(lang: str | None = None, text: str = TEXT) -> list[tuple[str, str]]:
    """(language, text) of every fenced snippet of a Markdown text (default: the README), in order; a snippet
    indented under a list item is returned dedented."""
    found = [(lg, textwrap.dedent(body)) for lg, body in re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M)]
    return [(lg, body) for lg, body in found if lang is None or lg == lang]


def snippet(marker: str) -> str:
    """The one fenced snippet containing `marker`."""
    hits = [body for _, body in snippets() if marker in body]
    assert len(hits) == 1, f"{len(hits)} README snippets contain {marker!r}"
    return hits[0]


def is_output(line: str) -> bool:
    return line == "#" or line.startswith("# ")


def shown(lines: list[str]) -> list[str]:
    """The printed-output lines among `lines`, without their '# ', times masked."""
    return [mask(line[2:]) for line in lines if is_output(line)]


def mask(line: str) -> str:
    return TIME.sub(" <t>s", line.rstrip())


def printed(text: str) -> list[str]:
    return [mask(line) for line in text.rstrip("\n").split("\n")] if text.strip() else []


DECIMAL = re.compile(r"-?\d+\.\d+")
DECIMAL_TOLERANCE = 1e-4


def same_line(want: str, got: str) -> bool:
    """Whether a printed line shows what the README's line shows: equal text outside the decimal figures, and each
    decimal figure within a relative DECIMAL_TOLERANCE of the README's."""
    if DECIMAL.split(want) != DECIMAL.split(got):
        return False
    pairs = zip(map(float, DECIMAL.findall(want)), map(float, DECIMAL.findall(got)))
    return all(math.isclose(a, b, rel_tol=DECIMAL_TOLERANCE) for a, b in pairs)


def same_lines(want: list[str], got: list[str]) -> bool:
    return len(want) == len(got) and all(same_line(w, g) for w, g in zip(want, got))


def test_every_readme_snippet_is_run_by_a_test():
    all_snippets = snippets()
    assert {lg for lg, _ in all_snippets} <= {"python", "bash"}
    for _, body in all_snippets:
        owners = [m for m in CLAIMED if m in body]
        install_only = all(m in body for m in INSTALL_ONLY) and all(
            line.startswith("make ") or line.lstrip().startswith("# ") for line in body.strip().split("\n"))
        assert owners or install_only, f"no test runs this README snippet:\n{body}"
    for marker in CLAIMED:
        snippet(marker)  # each claimed marker names exactly one snippet


def test_output_lines_are_parsed_from_the_snippets():
    body = snippet(PY_FIRST)
    assert shown(body.split("\n")) == ["The magic number is 4217. This is a classic example of"]
    assert mask("time prefill 1.21s (compression 0.19s), decode 12s") == "time prefill <t>s (compression <t>s), decode <t>s"
    assert mask("yes    73%  167.8s  'a'") == mask("yes    73%    4.4s  'a'") == "yes    73% <t>s  'a'"


def test_a_shown_decimal_matches_within_its_tolerance_and_nothing_else_does():
    want = "| full cache | 512 | 2 | 12.821 [0.502, 327.721] | 1 | 100% |"
    assert same_line(want, want.replace("327.721", "327.726"))  # 1.5e-5 apart
    assert not same_line(want, want.replace("327.721", "327.821"))  # 3e-4 apart
    assert not same_line(want, want.replace("| 512 |", "| 513 |"))  # integers exactly
    assert not same_line(want, want.replace("full cache", "full  cache"))
    assert not same_line(want, want.replace("12.821", "12.8"))  # 1.6e-3 apart
    assert not same_line("the 4217. This", "the 4218. This")
    assert same_lines([want], [want]) and not same_lines([want], [want, want])


# ---------------------------------------------------------------------------------------------------------------
# Python snippets


def run_python(code: str, namespace: dict) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    return out.getvalue()


def test_the_tensor_level_example_prints_what_the_readme_shows():
    code = snippet(PY_TENSOR)
    assert "pre_rope_keys=pre_rope_keys" in code  # Compactor and the hybrid need them
    out = run_python(code, {})
    assert same_lines(shown(code.split("\n")), printed(out)), (shown(code.split("\n")), printed(out))


@pytest.fixture(scope="module")
def readme_session():
    """The model-loading Python snippets run in README order in one namespace (they build on each other):
    {marker: (namespace after it, stdout)}; the first one loads the default model as printed."""
    namespace: dict = {}
    runs = {}
    for marker in (PY_FIRST, PY_PIPELINE, PY_BATCH, PY_REPORT):
        out = run_python(snippet(marker), namespace)
        runs[marker] = (dict(namespace), out)
    return runs


@pytest.mark.e2e
@pytest.mark.smoke
@pytest.mark.parametrize("marker", [PY_FIRST, PY_PIPELINE, PY_BATCH, PY_REPORT], ids=["first", "pipeline", "batch", "report"])
def test_python_example_prints_what_the_readme_shows(readme_session, marker):
    expected = shown(snippet(marker).split("\n"))
    assert expected, "the README shows no output for this example"
    assert same_lines(expected, printed(readme_session[marker][1])), (expected, printed(readme_session[marker][1]))


@pytest.mark.e2e
@pytest.mark.smoke
def test_the_first_example_prose_snapkv_budget_and_the_hybrid(readme_session, monkeypatch):
    """'On this 168-token prompt, half the cache leaves SnapKV a middle budget of only 16 tokens beside its exact
    sink (4) and window (64). It answers "...". KeyDiff and the hybrid keep the needle.'"""
    import kvcompress as kvc
    from kvcompress.methods import get_method_class

    claim = re.search(r"On this (\d+)-token prompt, half the cache leaves SnapKV a middle budget of only (\d+) tokens\s+"
                      r"beside its exact sink \((\d+)\) and window \((\d+)\)\. It answers \"([^\"]+)\"\. KeyDiff and the\s+hybrid keep the needle",
                      TEXT)
    assert claim, "the README's sentence about the first example changed: update this test with it"
    n, budget, sink, window = map(int, claim.groups()[:4])
    namespace = readme_session[PY_FIRST][0]
    model, tokenizer = namespace["model"], namespace["tokenizer"]
    monkeypatch.setattr(kvc, "load_model", lambda *a, **k: (model, tokenizer))  # the model the snippet loaded
    code = snippet(PY_FIRST)
    answers = {}
    for method in ("snapkv", "hybrid"):
        ns: dict = {}
        out = run_python(code.replace('"keydiff"', f'"{method}"'), ns)
        answers[method] = out.strip()
        if method == "snapkv":
            assert ns["inputs"]["input_ids"].shape[1] == n
            assert (get_method_class("snapkv").default_sink, get_method_class("snapkv").default_window) == (sink, window)
            assert math.ceil(0.5 * n) - sink - window == budget  # half the prompt kept: sink + middle + window
            generated = ns["out"].shape[1] - n
            # prefill mode: sink + middle + window of the prompt, then the exact tail of the answer (its last token is never fed)
            assert set(ns["cache"].slots_per_layer()) == {sink + budget + window + generated - 1}
    assert answers["snapkv"].startswith(claim.group(5)) and "4217" not in answers["snapkv"], answers
    assert "4217" in answers["hybrid"], answers
    assert "4217" in readme_session[PY_FIRST][1]


@pytest.mark.e2e
@pytest.mark.smoke
def test_each_batch_row_answers_as_it_does_alone(readme_session):
    """'each row gets the answer it gets alone': both batch paths of the README, against each row run alone."""
    import kvcompress as kvc

    ns = readme_session[PY_BATCH][0]
    model, tokenizer, question = ns["model"], ns["tokenizer"], ns["question"]
    method, = re.findall(r'CompressedCache\(model, "(\w+)"', snippet(PY_BATCH))
    batch_cache_rows = tokenizer.batch_decode(ns["out"][:, ns["batch"]["input_ids"].shape[1]:], skip_special_tokens=True)
    for row, prompt in enumerate(ns["prompts"]):
        one = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
        cache = kvc.CompressedCache(model, method, compression_ratio=0.5)
        out = model.generate(**one, past_key_values=cache, max_new_tokens=16, do_sample=False)
        assert tokenizer.decode(out[0, one["input_ids"].shape[1]:], skip_special_tokens=True) == batch_cache_rows[row]
        alone = kvc.generate(model, tokenizer, ns["contexts"][row], question, method=method, compression_ratio=0.5, max_new_tokens=16)
        assert alone.text == ns["results"][row].text
    assert "4217" in batch_cache_rows[0] and "12" in batch_cache_rows[1]  # the right answers, as the README shows
    assert "4217" in ns["results"][0].text and "12" in ns["results"][1].text


# ---------------------------------------------------------------------------------------------------------------
# Shell snippets


def commands(body: str) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) for each command of a shell snippet (continuation lines joined)."""
    result: list[tuple[str, list[str]]] = []
    pending = ""
    for line in body.split("\n"):
        if is_output(line):
            assert result, f"output shown before any command: {line!r}"
            result[-1][1].append(line)
        elif line.strip():
            pending += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                result.append((pending.strip(), []))
                pending = ""
    assert not pending, f"unfinished command: {pending!r}"
    return result


def argv(command: str) -> list[str]:
    """The kvcompress arguments of a command line (its trailing `# comment` dropped)."""
    words = shlex.split(command, comments=True)
    assert words[0] == "kvcompress", command
    return words[1:]


def run_shell(command: str, cwd: Path, timeout: int = 600) -> str:
    """Run one README command with bash in `cwd`, the venv's python and kvcompress first on PATH, at this test process's
    torch threads (conftest.py's: one per xdist worker, so that a command does not crowd the other worker); its stdout."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stderr[-3000:]}"
    return done.stdout


def assert_shown_in(shown_lines: list[str], out: str, command: str) -> None:
    """The README's shown lines appear in `out` in order (after time masking)."""
    lines = printed(out)
    at = 0
    for want in shown_lines:
        while at < len(lines) and not same_line(want, lines[at]):
            at += 1
        assert at < len(lines), f"{command}\nshows {want!r}, which it does not print (in that order):\n{out}"
        at += 1


def in_repo_copy(tmp_path: Path) -> Path:
    """A scratch working directory where the README's relative paths (tests/fixtures/...) resolve, outputs stay out of the repo."""
    (tmp_path / "tests").symlink_to(REPO / "tests")
    return tmp_path


def test_the_cli_help_commands_run():
    from kvcompress.cli import main

    helps = [c for c, _ in commands(snippet(SH_CLI)) if c.endswith("--help")]
    assert len(helps) == 3
    for command in helps:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(argv(command))
        assert status == 0 and out.getvalue().startswith(f"usage: kvcompress {argv(command)[0]}"), command


@pytest.mark.e2e
@pytest.mark.smoke
def test_the_cli_generate_example_prints_what_the_readme_shows(tmp_path):
    steps = commands(snippet(SH_CLI))
    makes_doc, generate = steps[0], steps[1]
    assert makes_doc[0].startswith("python -c") and "> doc.txt" in makes_doc[0] and generate[0].startswith("kvcompress generate")
    run_shell(makes_doc[0], tmp_path)
    assert generate[1], "the README shows no output for kvcompress generate"
    assert_shown_in(shown(generate[1]), run_shell(generate[0], tmp_path), generate[0])


@pytest.mark.e2e
def test_the_demo_prints_what_the_readme_shows(tmp_path):
    """`kvcompress demo` (what `make demo` runs after the set-up): the default first, then the full cache, both finding the
    needle of a 700-token document ("one question about a 700-token document" in the set-up section)."""
    (command, output), = commands(snippet(SH_DEMO))
    assert command == "kvcompress demo" and output
    out = run_shell(command, tmp_path)
    assert_shown_in(shown(output), out, command)
    tokens = int(re.search(r"^context: (\d+) tokens", out, re.M).group(1))
    assert 650 <= tokens <= 750 and "700-token document" in snippet("make demo")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("method "))
    rows = [line.split()[:2] for line in lines[head + 1:] if line.strip()]
    assert rows[:2] == [["default", "yes"], ["full", "yes"]], out


@pytest.mark.e2e
@pytest.mark.smoke
def test_compress_once_then_generate_from_the_saved_cache(readme_session, tmp_path, monkeypatch):
    """The README's `kvcompress compress ... --out doc.kvc` then `kvcompress generate --cache doc.kvc`, on the doc.txt of the
    command-line example, in-process with the model the first example loaded."""
    from kvcompress.cli import main
    from kvcompress.integration import model as model_module

    namespace = readme_session[PY_FIRST][0]
    monkeypatch.setattr(model_module, "load_model", lambda *a, **k: (namespace["model"], namespace["tokenizer"]))
    monkeypatch.chdir(tmp_path)
    run_shell(commands(snippet(SH_CLI))[0][0], tmp_path)  # writes doc.txt
    steps = commands(snippet(SH_SAVED))
    assert [argv(c)[0] for c, _ in steps] == ["compress", "generate"] and "--cache doc.kvc" in steps[1][0]
    for command, output in steps:
        assert output, f"the README shows no output for {command}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(argv(command)) == 0, command
        assert_shown_in(shown(output), out.getvalue(), command)
    assert (tmp_path / "doc.kvc").is_file()


def shell_runs(marker: str) -> list[tuple[str, list[str]]]:
    steps = commands(snippet(marker))
    assert steps and all(c.startswith("kvcompress ") for c, _ in steps)
    return steps


@pytest.mark.e2e
@pytest.mark.parametrize("flag, leaderboard", [("--benchmark longbench", "lb/leaderboard_longbench.md"), ("--benchmark ruler", "ruler/leaderboard_ruler.md")])
def test_the_benchmark_commands_on_the_shipped_samples(tmp_path, flag, leaderboard):
    cwd = in_repo_copy(tmp_path)
    (command, output), = [s for s in shell_runs(SH_BENCHMARKS) if flag in s[0]]
    assert output
    assert_shown_in(shown(output), run_shell(command, cwd), command)
    assert (cwd / "results" / leaderboard).is_file()


@pytest.mark.e2e
def test_the_perplexity_command(tmp_path):
    (command, output), = shell_runs(SH_PERPLEXITY)
    assert output
    assert_shown_in(shown(output), run_shell(command, tmp_path), command)
    assert (tmp_path / "results" / "ppl" / "leaderboard_perplexity.md").is_file()


def readme_kvcompress_commands() -> list[str]:
    """Every `kvcompress ...` command of the README: inline code spans (also across lines), indented blocks, fenced snippets."""
    inline = [" ".join(span.split()) for span in re.findall(r"`(kvcompress (?:generate|compress|demo|eval|bench|calibrate)\b[^`]*)`", TEXT)]
    joined = TEXT.replace("\\\n", " ")
    indented = [" ".join(line.split()) for line in re.findall(r"^    (kvcompress .*)$", joined, re.M)]
    fenced = [c for lang, body in snippets("bash") for c, _ in commands(body) if c.startswith("kvcompress ")]
    return inline + indented + fenced


def test_every_kvcompress_command_in_the_readme_parses_with_todays_cli():
    """Every `kvcompress` command the README names (inline spans, indented blocks, snippets), the GPU recipe's `kvcompress
    eval` among them (it needs RULER's generated data and an 8B model, so only its arguments are checked here), parses
    with today's command line."""
    from kvcompress.cli import build_parser

    found = readme_kvcompress_commands()
    gpu = [c for c, _ in commands(snippet(SH_RULER_GPU)) if c.startswith("kvcompress ")]
    assert len(gpu) == 1 and gpu[0] in found
    parser = build_parser()
    for command in found:
        if command.endswith("--help"):
            continue
        args = parser.parse_args(argv(command))
        assert callable(args.func), command


def test_every_benchmark_script_the_docs_name_exists_and_takes_its_flags():
    """`[python] benchmarks/x.py --flag ...` in the README or docs/: the script exists and defines each flag."""
    text = " ".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]).replace("\\\n", " ")
    runs = re.findall(r"(benchmarks/[\w/]+\.py)((?:\s+--[a-z][\w-]*(?:\s+[^\s`-][^\s`]*)*)*)", text.replace("\n", " "))
    flags_checked = 0
    for script, flags in runs:
        path = REPO / script
        source = path.read_text()
        for module in re.findall(r"^(?:from|import) (\w+)", source, re.M):  # a sibling script whose parser it shares
            sibling = [p for p in (path.parent / f"{module}.py", REPO / "benchmarks" / f"{module}.py") if p.is_file()]
            source += "".join(p.read_text() for p in sibling[:1])
        for flag in set(re.findall(r"--[a-z][\w-]*", flags)) - {"--help"}:  # argparse's own
            assert f'"{flag}"' in source, f"{script} has no {flag}"
            flags_checked += 1
    assert flags_checked > 20  # the docs' commands are read, flags and all"


def test_every_results_path_the_readme_cites_exists():
    paths = set(re.findall(r"(?<![\w/])((?:benchmarks|results|docs|tests)/[\w./{},-]*[\w/}])", TEXT))
    skip = {"results/lb", "results/ruler", "results/ppl", "results/ruler-8b"}  # written by the README's own commands
    for path in sorted(paths - skip):
        if "{" in path:  # results/x_text{0,2}/: each expansion
            head, alts, tail = re.match(r"(.*)\{([^}]*)\}(.*)", path).groups()
            expanded = [head + alt + tail for alt in alts.split(",")]
        else:
            expanded = [path]
        for p in expanded:
            assert (REPO / p).exists(), f"the README cites {p}, which does not exist"
