"""The command line: a parser that imports nothing heavy (its names come from `kvcompress.names`, which the library
imports too), subcommands independent of `kvcompress.cli`, and `generate` with --threads and a calibration file.

Start-up time itself is measured by benchmarks/cli_startup.py, not asserted here; these tests check
what makes it fast (building the parser, --help and argument errors import neither torch nor transformers).
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcompress.calibration import Calibration, optimal_retention
from kvcompress.cli import main
from kvcompress import names
from kvcompress.methods.registry import method_names

HEAVY = ("torch", "transformers", "numpy", "matplotlib", "scipy")
PACKAGE = Path(__file__).resolve().parent.parent / "kvcompress"


def test_parser_help_and_argument_errors_import_nothing_heavy():
    argv = [["--help"], ["--version"], *[[command, "--help"] for command in ("generate", "demo", "calibrate", "bench", "eval")],
            ["generate", "--context-file", "c.txt", "--budget", "many"], ["generate", "--context-file", "c.txt", "--method", "zip"],
            ["generate", "--context-file", "c.txt", "--threads", "0"], ["bench", "--sections", "speed"], ["bench", "--memory-method", "zip"],
            ["eval", "--modes", "fast"], ["calibrate", "--out", "c.json", "--tasks", "haystack"], ["demo", "--methods", "zip"]]
    script = f"""
import sys
from kvcompress.cli import build_parser, main
build_parser()
statuses = [main(argv) for argv in {argv!r}]
print(statuses, sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r})))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"{[0] * 7 + [2] * 8} []"


def test_the_version_is_the_installed_distributions_on_the_command_line_and_in_python(capsys):
    """`kvcompress --version` prints `kvcompress <version>` on stdout and exits 0; `kvcompress.__version__` is the same, the
    version pyproject.toml declares (the package is installed from this tree)."""
    import tomllib

    import kvcompress

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["version"]
    capsys.readouterr()
    assert main(["--version"]) == 0
    assert capsys.readouterr() == (f"kvcompress {declared}\n", "")
    assert kvcompress.__version__ == declared


def test_a_source_tree_not_installed_has_no_version_and_says_so(monkeypatch, capsys, tmp_path):
    """Imported from a source tree without `pip install`, there is no package metadata: `kvcompress.__version__` is an
    AttributeError saying how to record it, `--version` one error line (exit 2, not a traceback), and an eval folder's
    config.json records the kvcompress version as null beside torch's and transformers'."""
    import importlib.metadata
    import json

    import kvcompress
    from kvcompress.eval.runner import SweepConfig, write_run_config

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(AttributeError, match=r"kvcompress has no __version__: .* \(pip install -e \. records it\)"):
        kvcompress.__version__
    capsys.readouterr()
    assert main(["--version"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kvcompress: error: kvcompress has no __version__") and err.count("\n") == 1
    write_run_config(tmp_path, SweepConfig(methods=["knorm"], ratios=[0.5], tasks=["niah_single"], lengths=[200], samples=1), "tiny", None)
    recorded = json.loads((tmp_path / "config.json").read_text())["versions"]
    assert recorded["kvcompress"] is None and recorded["torch"] == torch.__version__ and recorded["transformers"]



def test_eval_under_an_ascii_locale_writes_its_reports_in_utf8_and_prints_what_the_terminal_cannot_show_escaped(tiny_checkpoint, tmp_path):
    """Under an ASCII locale (LC_ALL=C with Python's UTF-8 mode and locale coercion off) the sweep ran and then stopped
    with "'ascii' codec can't encode character '\\u2013'" writing summary.md: files are now UTF-8 and the terminal gets
    escapes."""
    out = tmp_path / "run"
    env = os.environ | {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, "-m", "kvcompress", "eval", "--model", str(tiny_checkpoint), "--tasks", "niah_single",
                           "--lengths", "128", "--samples", "1", "--methods", "knorm", "--ratios", "0.5", "--max-new-tokens", "2",
                           "--no-progress", "--out", str(out)], capture_output=True, env=env, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert "\u2013" in (out / "summary.md").read_text(encoding="utf-8") and b"\\u2013" in done.stdout

def test_the_method_names_the_parser_accepts_are_the_registered_methods():
    """The parser reads `kvcompress.names.METHODS`, the library the registry, which each method's module fills when it
    is imported (`@register`): a method registered but not listed, or listed but not registered, fails here."""
    assert list(names.METHODS) == method_names()


def test_the_sweep_default_tasks_are_every_task():
    from kvcompress.eval.runner import DEFAULT_TASKS
    from kvcompress.eval.tasks import TASKS

    assert DEFAULT_TASKS == TASKS  # `kvcompress eval --help` shows TASKS as the default


@pytest.mark.parametrize("path", [*sorted((PACKAGE / "commands").glob("*.py")), PACKAGE / "demo.py"], ids=lambda p: p.name)
def test_subcommands_do_not_import_the_module_that_loads_them(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "cli" and not (node.module or "").endswith(".cli"), f"{path.name}:{node.lineno} imports kvcompress.cli"
            package = node.module is None or node.module == "kvcompress"  # from .. import cli, from kvcompress import cli
            assert not (package and any(a.name == "cli" for a in node.names)), f"{path.name}:{node.lineno} imports kvcompress.cli"
        elif isinstance(node, ast.Import):
            assert all(a.name != "kvcompress.cli" for a in node.names), f"{path.name}:{node.lineno} imports kvcompress.cli"


@pytest.fixture
def context_file(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text("The magic number is 42. The sky is green today. " * 20)
    return path


def test_generate_sets_the_torch_threads(tiny_checkpoint, context_file, capsys):
    before = torch.get_num_threads()
    threads = 2 if before == 1 else 1
    try:
        assert main(["generate", "--model", str(tiny_checkpoint), "--method", "full", "--context-file", str(context_file),
                     "--max-new-tokens", "2", "--threads", str(threads)]) == 0
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert "method            full" in capsys.readouterr().out


def test_generate_compresses_at_the_ratio_a_calibration_file_chooses(tiny_checkpoint, context_file, tmp_path, capsys):
    """alpha = 0: the curve does not depend on the context's NLL, so the ratio is known in closed form (r* at k = beta)."""
    path = tmp_path / "knorm.json"
    Calibration("knorm", alpha=0.0, beta=-3.0).save(path)
    assert main(["generate", "--model", str(tiny_checkpoint), "--calibration", str(path), "--quality", "0.8",
                 "--context-file", str(context_file), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    ratio = 1 - optimal_retention(-3.0, 0.8)
    assert 0.4 < ratio < 0.6
    assert "method            knorm (mode=prefill" in out  # the calibration's method: no --method given
    assert f"(compression ratio {ratio:.3f}) for quality 0.8" in out


def test_generate_refuses_a_calibration_of_another_method_with_the_error_python_gives(context_file, tmp_path, capsys):
    """One check, in CompressionOptions, for the command line and Python alike; refused before a model loads, the command
    line's message naming the flag."""
    from kvcompress.options import CompressionOptions

    path = tmp_path / "compactor.json"
    Calibration("compactor", alpha=0.0, beta=-3.0).save(path)
    with pytest.raises(ValueError) as python:
        CompressionOptions(method="keydiff", quality=0.9, calibration=path)
    assert "fitted for method 'compactor', got method='keydiff'" in str(python.value)
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--method", "keydiff", "--calibration", str(path), "--quality", "0.9",
                 "--context-file", str(context_file)]) == 2
    # the same words, the parameter named by its flag (`cli.as_flag`)
    assert capsys.readouterr().err.strip() == f"kvcompress generate: error: --{python.value}".replace("method='keydiff'", "--method keydiff")


def test_generate_refuses_a_calibration_fitted_on_another_model(context_file, tmp_path, capsys):
    """A curve predicts the quality of the model it was fitted on: a file recording another model is refused, naming both,
    before the model loads; one recording no model (written by a library call without model_name) is taken as it is."""
    path = tmp_path / "knorm.json"
    Calibration("knorm", alpha=0.0, beta=-3.0, model="SmolLM2-135M-Instruct").save(path)
    assert main(["generate", "--model", str(tmp_path / "gemma.gguf"), "--calibration", str(path), "--quality", "0.9",
                 "--context-file", str(context_file)]) == 2
    assert "was fitted on model 'SmolLM2-135M-Instruct', this run's is 'gemma.gguf'" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:the context's NLL .* lies outside the range")  # a one-sample fit: an extrapolation
def test_a_file_written_by_kvcompress_calibrate_drives_generate(tiny_checkpoint, context_file, tmp_path, capsys):
    path = tmp_path / "knorm.json"
    assert main(["calibrate", "--model", str(tiny_checkpoint), "--method", "knorm", "--tasks", "niah_single", "--samples", "2",
                 "--tokens", "300", "--retentions", "0.5,1", "--out", str(path)]) == 0
    calibration = Calibration.load(path)
    assert calibration.method == "knorm" and calibration.n_triples == 4
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_checkpoint), "--method", "knorm", "--calibration", str(path), "--quality", "0.99",
                 "--context-file", str(context_file), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "method            knorm" in out and "calibration       NLL(context) " in out and "for quality 0.99" in out


def test_compress_takes_kv_bits_auto_and_refuses_other_bits(tiny_checkpoint, tmp_path, capsys):
    """`--kv-bits auto --budget-unit memory`: at ratio 0.5 the tiny model's context is stored in 8 bits, at 0.9 in 4
    (`CompressionOptions.kv_bits`); a width that is not stored, or "auto" without the memory unit, is an error naming
    what is accepted."""
    from kvcompress.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The archivist was Margaret Okafor. " * 40)
    flags = ["--context-file", str(doc), "--method", "knorm", "--sink", "2", "--window", "4", "--model", str(tiny_checkpoint)]
    for ratio, bits in (("0.5", 8), ("0.9", 4)):
        assert main(["compress", *flags, "--compression-ratio", ratio, "--kv-bits", "auto", "--budget-unit", "memory",
                     "--out", str(tmp_path / "doc.kvc")]) == 0
        assert f"{bits}-bit" in capsys.readouterr().out
    assert main(["compress", *flags, "--compression-ratio", "0.5", "--kv-bits", "3", "--out", str(tmp_path / "x.kvc")]) != 0
    assert "argument --kv-bits: expected one of 8, 4, 2 or auto, got '3'" in capsys.readouterr().err
    assert main(["compress", *flags, "--compression-ratio", "0.5", "--kv-bits", "auto", "--out", str(tmp_path / "x.kvc")]) != 0
    assert ("--kv-bits auto picks the bits from the bytes the ratio leaves a prefilled context: it takes --budget-unit memory"
            in capsys.readouterr().err)


def test_compress_saves_a_cache_that_generate_answers_from(tiny_checkpoint, tmp_path, capsys):
    """`kvcompress compress --out` then `generate --cache`: the same answer as `generate --context-file` with the same flags."""
    from kvcompress.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text("The archivist was Margaret Okafor. " * 20)
    flags = ["--method", "knorm", "--compression-ratio", "0.5", "--sink", "2", "--window", "4", "--kv-bits", "4", "--model", str(tiny_checkpoint)]
    assert main(["compress", "--context-file", str(doc), "--out", str(tmp_path / "doc.kvc"), *flags]) == 0
    assert "4-bit" in capsys.readouterr().out
    ask = ["--question", "Who was the archivist?", "--max-new-tokens", "4", "--model", str(tiny_checkpoint)]
    assert main(["generate", "--cache", str(tmp_path / "doc.kvc"), *ask]) == 0
    from_cache = capsys.readouterr().out.split("\n")[0]
    assert main(["generate", "--context-file", str(doc), *flags[:-2], *ask]) == 0
    assert capsys.readouterr().out.split("\n")[0] == from_cache
    assert main(["generate", "--cache", str(tmp_path / "doc.kvc"), "--method", "snapkv", *ask]) == 2
    assert "--cache answers with the settings the cache was compressed with: it takes no --method" in capsys.readouterr().err
    assert main(["generate", "--cache", str(tmp_path / "missing.kvc"), *ask]) == 2
    assert main(["compress", "--context-file", str(doc), "--out", str(tmp_path), *flags]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_generate_json_prints_one_object_with_the_answer_and_every_statistic(tiny_checkpoint, tmp_path, capsys):
    """`generate --json`, from a context file and from a saved cache: stdout is one JSON object a question, the question
    and `GenerationResult.to_dict()` (every field, `decode_tokens_per_second` beside them), whose answer is the text
    mode's. Several --question flags are answered from one compressed context, each as it is alone, in order."""
    import dataclasses
    import json

    from kvcompress.cli import main
    from kvcompress.integration.generation import GenerationResult

    doc = tmp_path / "doc.txt"
    doc.write_text("The archivist was Margaret Okafor. " * 20)
    flags = ["--method", "knorm", "--compression-ratio", "0.5", "--sink", "2", "--window", "4", "--model", str(tiny_checkpoint),
             "--question", "Who was the archivist?", "--max-new-tokens", "4"]
    assert main(["generate", "--context-file", str(doc), *flags]) == 0
    text = capsys.readouterr().out.split("\n")[0]
    assert main(["generate", "--context-file", str(doc), *flags, "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out)
    assert out.count("\n") == 1 and result["text"] == text and len(result["token_ids"]) == 4
    assert set(result) == {f.name for f in dataclasses.fields(GenerationResult)} | {"decode_tokens_per_second", "question"}
    assert result["question"] == "Who was the archivist?"
    assert result["method"] == "knorm" and result["mode"] == "prefill" and 0 < result["kv_bytes"] < result["kv_bytes_full"]
    # an answer the terminal's encoding may not show is escaped as JSON escapes it (valid JSON in any encoding)
    from types import SimpleNamespace

    from kvcompress.commands.generate import _print_results

    fields = {f.name: result[f.name] for f in dataclasses.fields(GenerationResult)}
    printed = _print_results(GenerationResult(**fields | {"text": "Caf\u00e9 \U0001f600"}), SimpleNamespace(json=True, question=None))
    assert printed == 0
    line = capsys.readouterr().out
    assert line.isascii() and json.loads(line)["text"] == "Caf\u00e9 \U0001f600"
    assert main(["compress", "--context-file", str(doc), *flags[:-4], "--out", str(tmp_path / "doc.kvc")]) == 0
    capsys.readouterr()
    assert main(["generate", "--cache", str(tmp_path / "doc.kvc"), *flags[8:], "--json"]) == 0  # --model and the question
    assert json.loads(capsys.readouterr().out)["token_ids"] == result["token_ids"]
    # several questions, one compressed context: each answer as the question's alone, from the file and from the cache
    others = ["--question", "Who?", "--question", "What was the archivist's name?"]
    alone = []
    for question in ("Who was the archivist?", "Who?", "What was the archivist's name?"):
        assert main(["generate", "--context-file", str(doc), *flags[:10], "--question", question, "--max-new-tokens", "4", "--json"]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    for source in (["--context-file", str(doc), *flags[:10]], ["--cache", str(tmp_path / "doc.kvc"), *flags[8:10]]):
        assert main(["generate", *source, *flags[10:], *others, "--json"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [(r["question"], r["token_ids"]) for r in map(json.loads, lines)] == [(r["question"], r["token_ids"]) for r in alone]
    assert main(["generate", "--context-file", str(doc), *flags, *others]) == 0
    blocks = capsys.readouterr().out.split("\n\nquestion          ")
    assert len(blocks) == 3 and blocks[0].startswith('question          "Who was the archivist?"\n' + alone[0]["text"] + "\n\nmethod ")
    assert blocks[2].startswith('"What was the archivist\'s name?"\n' + alone[2]["text"] + "\n\nmethod ")
    # a question holding a line break stays on its line
    assert main(["generate", "--context-file", str(doc), *flags[:10], "--question", "Who\nwas it?", "--question", "Who?",
                 "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith('question          "Who\\nwas it?"\n')


def test_eval_checks_its_results_folder_before_loading_the_model(tmp_path, capsys):
    """A results folder holding another run is refused before the model loads (here the model does not even exist)."""
    import json

    out = tmp_path / "sweep"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"config": {"seed": 0}, "model": "SmolLM2-135M-Instruct"}))
    assert main(["eval", "--seed", "3", "--model", str(tmp_path / "no-model"), "--out", str(out)]) == 2
    assert "holds the results of another run: seed (--seed) 3, there 0" in capsys.readouterr().err


def test_the_slack_help_states_the_defaults_the_library_uses():
    """`--slack`'s help gives the default method's slack and any other method's (`DEFAULT_SLACK`), as the library sets them."""
    from kvcompress.cli import build_parser
    from kvcompress.methods.budget import DEFAULT_SLACK
    from kvcompress.options import DEFAULT_METHODS

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = " ".join(next(a.help for a in generate._actions if "--slack" in a.option_strings).split())
    assert f"the default method's {DEFAULT_METHODS['chunked'][2]['slack']}, back to 10/11" in text
    assert f"any other method's {DEFAULT_SLACK}, back to 2/3" in text


def test_a_library_error_names_the_flag_of_the_parameter_it_starts_with():
    """`cli.as_flag`: a message that starts with a parameter's Python name names the subcommand's flag instead, and so
    does a name given with its value anywhere, and a name with an underscore anywhere (they were left as Python names:
    "use compression_ratio <= 0.8413"); a word no flag has, a plain word mid-sentence and a flag of another subcommand are
    left as they are."""
    from kvcompress.cli import as_flag, build_parser

    generate = build_parser().subcommands["generate"]
    assert as_flag("compression_ratio must be in [0, 1), got 1.5", generate) == "--compression-ratio must be in [0, 1), got 1.5"
    assert as_flag("budget must be an integer >= 1, got 0", generate) == "--budget must be an integer >= 1, got 0"
    assert as_flag("quality (the NLL-ratio budget gamma) must be in (0, 1]", generate) == "--quality (the NLL-ratio budget gamma) must be in (0, 1]"
    assert as_flag("kv_bits='auto' picks the bits", generate) == "--kv-bits auto picks the bits"
    assert (as_flag("compression_ratio=0.9 keeps 44 of n=435 tokens beyond sink=4 + window=64; use compression_ratio <= 0.8413", generate)
            == "--compression-ratio 0.9 keeps 44 of n=435 tokens beyond --sink 4 + --window 64; use --compression-ratio <= 0.8413")
    assert (as_flag("compress_question=True changes nothing in mode='decode'; leave budget_unit unset", generate)
            == "--compress-question changes nothing in --mode decode; leave --budget-unit unset")
    for unchanged in ("the context is empty", "context_fraction must be in (0, 1)", "the method keeps a budget",
                      "calibrate it (`kvc.calibrate(model, tokenizer, samples, method='snapkv')`)", ""):
        assert as_flag(unchanged, generate) == unchanged
    # a name followed by its flag is said once (it read "--max-new-tokens (--max-new-tokens) 2, there None"); a task's
    # parameters named by the task alone name the flag too
    evaluate = build_parser().subcommands["eval"]
    assert (as_flag("runs holds the results of another run: max_new_tokens (--max-new-tokens) 2, there not given", evaluate)
            == "runs holds the results of another run: --max-new-tokens 2, there not given")
    assert (as_flag("task_params['niah_single']: parameters must be among ['haystack', 'kind']", evaluate)
            == "--task-param niah_single.NAME: parameters must be among ['haystack', 'kind']")


def test_path_flags_expand_a_leading_tilde_and_keep_the_rest_as_typed(monkeypatch, tmp_path):
    """`--out=~/x` (no shell expands that `~`) is the home folder's x; --model and --scorer, names a run records and
    compares, keep the rest as typed (`./ckpt/` stayed `./ckpt/` before; a rewritten `ckpt` refused resuming the run)."""
    from kvcompress.commands.common import results_folder, user_path, user_path_text

    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_path("~/x.kvc") == tmp_path / "x.kvc" and results_folder("~/runs") == tmp_path / "runs"
    assert user_path_text("~/ckpt/") == f"{tmp_path}/ckpt/" and user_path_text("./ckpt/") == "./ckpt/"
    assert user_path_text("models//x") == "models//x"
