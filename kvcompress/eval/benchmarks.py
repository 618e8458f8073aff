"""Standard long-context benchmarks read from local files in their published formats.

`load_benchmark(name, path, tasks=None, limit=None)` returns `BenchmarkItem`s; `item.score(text)`
applies the benchmark's own metric (`eval.metrics`). Files are read with `datasets` (offline):
a .jsonl / .parquet file, a directory searched recursively for them, or a directory written by
`datasets.Dataset.save_to_disk`. Nothing is downloaded.

- ``ruler``: the jsonl of RULER's `prepare.py` (`input`, `outputs`, `length`, optional
  `answer_prefix`), one file per task: `<task>/validation.jsonl` (task = folder) or `<task>.jsonl`.
  RULER's templates end with the question on its own line: the question is what follows the last
  line break of `input`, the rest is the context. Prepare the data with RULER's
  `--model_template_type base` (the model's chat template is applied here, by `build_prompt`). Metric string-match-all (string-match-part for
  the `qa_*` tasks); answer lengths by task family (niah 128, vt 30, cwe 120, fwe 50, qa 32 tokens).
- ``longbench`` / ``longbench-e``: `<dataset>.jsonl` / `<dataset>_e.jsonl` with `context`,
  `input`, `answers`, `all_classes`, `length`; each dataset's metric and answer length (LongBench's
  `dataset2maxlen`); LongBench-E rows fall into the length buckets 0-4k / 4-8k / 8k+ of `length`
  (words, or characters for Chinese). The instruction after the context is ours (LongBench's prompt
  texts are not reproduced), so scores compare methods, not published LongBench numbers. For
  trec, triviaqa, samsum and lsht only the first line of the answer is scored, as LongBench does.
- ``infinitebench``: `<task>.jsonl` with `context`, `input`, `answer`, `options`; InfiniteBench's
  metric and answer length per task.
- ``kvpress``: kvpress's evaluation parquet (`context`, `question`, `answer_prefix`, `answer`,
  `task`, `max_new_tokens`, optional `all_classes`); the metric follows the task name (RULER,
  LongBench or InfiniteBench task names).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from .metrics import METRICS, OPTION_LETTERS, answer_problem, require_metric_packages
from .tasks import Sample, token_counter

BENCHMARKS = ("ruler", "longbench", "longbench-e", "infinitebench", "kvpress")
LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")

_QA = "Answer the question based on the text above, as briefly as possible.\n\nQuestion: {input}\nAnswer:"
_QA_ZH = "请根据上文回答问题，尽量简短。\n\n问题：{input}\n回答："
# dataset: (metric, answer tokens, question template, score the first line only)
LONGBENCH_TASKS: dict[str, tuple[str, int, str, bool]] = {
    "narrativeqa": ("qa_f1", 128, _QA, False),
    "qasper": ("qa_f1", 128, _QA + " (write \"unanswerable\" if the text does not say, \"yes\"/\"no\" for yes/no questions)", False),
    "multifieldqa_en": ("qa_f1", 64, _QA, False),
    "multifieldqa_zh": ("qa_f1_zh", 64, _QA_ZH, False),
    "hotpotqa": ("qa_f1", 32, _QA, False),
    "2wikimqa": ("qa_f1", 32, _QA, False),
    "musique": ("qa_f1", 32, _QA, False),
    "dureader": ("rouge_l_zh", 128, _QA_ZH, False),
    "gov_report": ("rouge_l", 512, "Summarise the report above in one page.\n\nSummary:", False),
    "qmsum": ("rouge_l", 512, "Answer the query about the meeting transcript above in a few sentences.\n\nQuery: {input}\nAnswer:", False),
    "multi_news": ("rouge_l", 512, "Summarise the news articles above in one page.\n\nSummary:", False),
    "vcsum": ("rouge_l_zh", 512, "请用一段话总结上面的会议记录。\n\n总结：", False),
    "trec": ("classification", 64, "Give the type of the last question, as in the examples above.\n\n{input}", True),
    "triviaqa": ("qa_f1", 32, "Answer the last question, as in the examples above.\n\n{input}", True),
    "samsum": ("rouge_l", 128, "Summarise the last dialogue, as in the examples above.\n\n{input}", True),
    "lsht": ("classification", 64, "判断最后这则新闻的类别，与上面的例子一样。\n\n{input}", True),
    "passage_count": ("count", 32, "How many different paragraphs are there in the text above once duplicates are removed? "
                      "Answer with one number.\n\nAnswer:", False),
    "passage_retrieval_en": ("retrieval", 32, "Which paragraph above is this abstract taken from? Answer like \"Paragraph 3\".\n\n"
                             "Abstract: {input}\n\nAnswer:", False),
    "passage_retrieval_zh": ("retrieval_zh", 32, "下面的摘要出自上文的哪一段？请按“段落3”的格式回答。\n\n摘要：{input}\n\n答案：", False),
    "lcc": ("code_similarity", 64, "Write the next line of the code above.\nNext line of code:\n", False),
    "repobench-p": ("code_similarity", 64, "{input}Next line of code:\n", False),
}
# task: (metric, answer tokens (InfiniteBench's), question template; {options} lists "A. ..." lines)
INFINITEBENCH_TASKS: dict[str, tuple[str, int, str]] = {
    "passkey": ("first_integer_match", 6, "{input}\n\nThe pass key is"),
    "number_string": ("first_integer_match", 12, "{input}\n\nThe sequence of digits is"),
    "kv_retrieval": ("word_match", 50, "{input}"),
    "longbook_sum_eng": ("rouge_lsum", 1200, "Summarise the book above.\n\nSummary:"),
    "longbook_choice_eng": ("option_choice", 40, "{input}\n\n{options}\n\nAnswer with the letter of the right option."),
    "longbook_qa_eng": ("qa_f1", 40, "Answer the question about the book above briefly.\n\nQuestion: {input}\nAnswer:"),
    "longbook_qa_chn": ("qa_f1_zh_chars", 40, "请根据上面的书简短地回答问题。\n\n问题：{input}\n答案："),
    "longdialogue_qa_eng": ("contains_upper", 40, "One occurrence of a character name above is replaced by \"$$MASK$$\". "
                            "Which character is it?\n\nThe name is"),
    "math_find": ("first_number_match", 3, "{input}\n\nThe answer is"),
    "math_calc": ("number_prefix", 30000, "Compute the intermediate value after each operation of the expression above.\n\nValues:"),
    "code_run": ("last_word_integer", 5, "{input}\n\nThe return value is:"),
    "code_debug": ("option_choice", 5, "Which function above has a deliberate error that makes it crash?\n\n{options}\n\n"
                   "Answer with the letter of the right option."),
}
# RULER task family (name prefix): (metric, answer tokens (RULER's tokens_to_generate))
RULER_TASKS: dict[str, tuple[str, int]] = {
    "niah": ("string_match_all", 128), "vt": ("string_match_all", 30), "variable_tracking": ("string_match_all", 30),
    "cwe": ("string_match_all", 120), "common_words": ("string_match_all", 120), "fwe": ("string_match_all", 50),
    "freq_words": ("string_match_all", 50), "qa": ("string_match_part", 32),
}


@dataclass(frozen=True)
class BenchmarkItem:
    """One benchmark sample: the context to compress, the question asked after it, the accepted answers.

    index: the item's position among its task's items (files in sorted order, rows in file order);
    source: "file:row" it came from. length: the data's own length field (RULER tokens, LongBench
    words or characters), bucket: the LongBench-E length bucket. extra: metric arguments
    (all_classes, options) as sorted (name, tuple) pairs.
    """

    benchmark: str
    task: str
    index: int
    context: str
    question: str
    answers: tuple[str, ...]
    metric: str
    max_new_tokens: int
    answer_prefix: str = ""
    length: int | None = None
    bucket: str | None = None
    first_line_only: bool = False
    extra: tuple = ()
    source: str = ""

    # A benchmark item is a sample of the sweep runner (`eval.runner.SampleSpec`'s interface).
    grid = False
    depth = None
    params = ()

    @property
    def kind(self) -> str:
        """First part of the sweep's cell key: the benchmark's name."""
        return self.benchmark

    def score(self, prediction: str) -> float:
        """The benchmark's metric of `prediction` (the text generated after the answer prefix), in [0, 1]."""
        if self.first_line_only:
            prediction = prediction.lstrip("\n").split("\n")[0]
        return METRICS[self.metric](prediction, self.answers, **dict(self.extra))

    def evaluate(self, sample: Sample, prediction: str) -> float:
        """`score(prediction)`; the built sample adds nothing (the item holds its answers)."""
        return self.score(prediction)

    def record_fields(self) -> dict:
        """What a sweep record of this item adds: benchmark, length bucket, metric and source row."""
        return {"benchmark": self.benchmark, "bucket": self.bucket, "metric": self.metric, "source": self.source}

    def build(self, config, tokenizer) -> Sample:
        """The item as a task `Sample` (context, question, answers, answer prefix, measured tokens, the
        benchmark's answer length; a one-line answer stops at the newline, as LongBench decodes them)."""
        n_tokens = round(token_counter(tokenizer)([self.context])[0])
        return Sample(task=self.task, context=self.context, question=self.question, answers=list(self.answers),
                      target_tokens=n_tokens, n_tokens=n_tokens, answer_prefix=self.answer_prefix,
                      max_new_tokens=self.max_new_tokens, stop=("\n",) if self.first_line_only else ())


def longbench_e_bucket(length: int) -> str:
    """LongBench-E's length bucket of a sample's `length`: 0-4k (< 4000), 4-8k (< 8000), 8k+."""
    return LONGBENCH_E_BUCKETS[0] if length < 4000 else LONGBENCH_E_BUCKETS[1] if length < 8000 else LONGBENCH_E_BUCKETS[2]


def load_benchmark(name: str, path: str | Path, tasks: list[str] | None = None, limit: int | None = None) -> list[BenchmarkItem]:
    """Every item of benchmark `name` under `path` (tasks None: all found), at most `limit` per task.

    Raises ValueError naming the file, the row and the field for a missing or malformed file.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"benchmark must be one of {BENCHMARKS}, got {name!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (samples per task), got {limit}")
    root = Path(path)
    if not root.exists():
        raise ValueError(f"--data {str(root)!r} does not exist")
    items: list[BenchmarkItem] = []
    per_task: dict[str, int] = {}
    found: set[str] = set()  # every task of the files, asked for or not
    for file, rows in _tables(root, name):
        for row_number, row in enumerate(rows):
            item = _PARSERS[name](_Row(file, row_number, row))
            problem = answer_problem(item.metric, item.answers)
            if problem is not None:
                raise _Row(file, row_number).error(_ANSWER_FIELDS[name], problem)
            found.add(item.task)
            if tasks is not None and item.task not in tasks:
                continue
            if limit is not None and per_task.get(item.task, 0) >= limit:
                continue
            index = per_task.get(item.task, 0)
            per_task[item.task] = index + 1
            items.append(replace(item, index=index))
    if tasks is not None:
        missing = sorted(set(tasks) - set(per_task))
        if missing:
            raise ValueError(f"tasks {missing} have no samples in {str(root)!r} ({name}); its tasks: {', '.join(sorted(found)) or 'none'}")
    if not items:
        raise ValueError(f"no {name} samples found in {str(root)!r}")
    for metric in sorted({item.metric for item in items}):
        require_metric_packages(metric)
    return items


def _tables(root: Path, name: str):
    """(file, rows) for every data file of the benchmark under root, files sorted."""
    if root.is_dir() and (root / "state.json").is_file():
        return [(root, _load_from_disk(root))]
    suffixes = (".jsonl", ".parquet")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in suffixes)
    if name == "longbench":
        files = [f for f in files if not f.stem.endswith("_e")]
    elif name == "longbench-e":
        files = [f for f in files if f.stem.endswith("_e")]
    if not files:
        raise ValueError(f"--data {str(root)!r} holds no {name} data file ({' or '.join(suffixes)})")
    return [(f, _read(f)) for f in files]


def _load_from_disk(root: Path) -> list[dict]:
    from datasets import load_from_disk

    try:
        return load_from_disk(str(root)).to_list()
    except Exception as err:  # datasets raises many types for a broken directory
        raise ValueError(f"{root}: not a readable datasets directory ({type(err).__name__}: {err})") from err


def _read(file: Path) -> list[dict]:
    """Rows of a jsonl or parquet file, read with `datasets` (offline); a malformed file names its bad row."""
    from ..checks import require_package  # here: the command line's parser imports this module, and checks imports torch

    datasets = require_package("datasets", "bench", "reading benchmark files")

    if file.stat().st_size == 0:
        raise ValueError(f"--data file {str(file)!r} is empty: a benchmark's data file holds one sample per row")
    datasets.disable_progress_bars()
    builder = "parquet" if file.suffix == ".parquet" else "json"
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a broken file is reported once, below, not also in datasets' log
    try:
        return datasets.load_dataset(builder, data_files=str(file), split="train").to_list()
    except Exception as err:  # datasets raises many types for a broken file: report the bad row ourselves
        if builder == "json":
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines()):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as bad:
                        raise ValueError(f"{file}: row {number}: not valid JSON ({bad})") from err
        raise ValueError(f"{file}: cannot be read as {builder} ({type(err).__name__}: {err})") from err
    finally:
        datasets.logging.set_verbosity(verbosity)


@dataclass
class _Row:
    """A data row with its origin, for error messages that name file, row and field."""

    file: Path
    number: int
    data: dict = field(default_factory=dict)

    @property
    def source(self) -> str:
        return f"{self.file}:{self.number}"

    def error(self, name: str, problem: str) -> ValueError:
        return ValueError(f"{self.file}: row {self.number}: field {name!r} {problem}")

    def text(self, name: str, optional: bool = False) -> str:
        value = self.data.get(name)
        if value is None and optional:
            return ""
        if not isinstance(value, str):
            raise self.error(name, "is missing" if value is None else f"must be text, got {type(value).__name__}")
        return value

    def answers(self, name: str) -> tuple[str, ...]:
        value = self.data.get(name)
        if _is_answer(value):
            return (str(value),)
        if isinstance(value, list) and value and all(_is_answer(v) for v in value):
            return tuple(str(v) for v in value)
        raise self.error(name, "is missing" if value is None else f"must be a non-empty list of answers, got {value!r}")

    def integer(self, name: str, optional: bool = False) -> int | None:
        value = self.data.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(name, "is missing" if value is None else f"must be an integer, got {value!r}")
        return value

    def strings(self, name: str) -> tuple[str, ...]:
        value = self.data.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(name, f"must be a list of strings, got {value!r}")
        return tuple(value)


def _classes(row: _Row, task: str, answers: tuple[str, ...]) -> tuple:
    """The extra field of a classification task: its class names (`all_classes`), which must list every answer (the
    metric scores an answer by the class names the prediction holds: one not among them always scores 0)."""
    classes = row.strings("all_classes")
    if not classes:
        raise row.error("all_classes", f"must list the class names for the classification task {task!r}")
    missing = [a for a in answers if a not in classes]
    if missing:
        raise row.error("all_classes", f"must hold every answer (one missing always scores 0), lacks {missing}")
    return (("all_classes", classes),)


def _template_input(row: _Row, template: str) -> str:
    """The row's `input` for a question template that places it: the field must be there (empty where the dataset's
    own rows are, as a summary task's), since a missing one would ask an empty question."""
    return row.text("input", optional="{input}" not in template)


def _is_answer(value) -> bool:
    """Whether one answer is text or a number (not a bool, which reads as 'True'; a float's decimals are kept)."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _ruler_family(task: str, row: _Row) -> tuple[str, int]:
    family = _ruler_family_of(task)
    if family is None:
        raise ValueError(f"{row.file}: RULER task {task!r} is unknown; task names are one of {sorted(RULER_TASKS)} or one of them, "
                         "an underscore and more (niah_single_1, qa_2)")
    return RULER_TASKS[family]


def _ruler_family_of(task: str) -> str | None:
    """The RULER task family (`RULER_TASKS`) a task name belongs to: the family's name itself or it followed by an
    underscore (niah_single_1, qa_2; "qaz" is none), None for none."""
    return next((f for f in RULER_TASKS if task == f or task.startswith(f + "_")), None)


def _parse_ruler(row: _Row) -> BenchmarkItem:
    task = row.file.parent.name if row.file.stem in ("validation", "test") else row.file.stem
    context, newline, question = row.text("input").rstrip().rpartition("\n")
    if not newline or not context.strip() or not question.strip():
        raise row.error("input", "must end with the question on its own line, as RULER's templates do with "
                        "--model_template_type base (kvcompress applies the model's chat template itself)")
    metric, max_new = _ruler_family(task, row)
    return BenchmarkItem("ruler", task, row.number, context, question, row.answers("outputs"), metric, max_new,
                         answer_prefix=row.text("answer_prefix", optional=True), length=row.integer("length"), source=row.source)


def _longbench_parser(benchmark: str):
    def parse(row: _Row) -> BenchmarkItem:
        dataset = row.text("dataset", optional=True) or row.file.stem
        task = dataset.removesuffix("_e")
        if task not in LONGBENCH_TASKS:
            raise row.error("dataset", f"names an unknown LongBench dataset {dataset!r}; known: {sorted(LONGBENCH_TASKS)}")
        metric, max_new, template, first_line = LONGBENCH_TASKS[task]
        answers = row.answers("answers")
        length = row.integer("length")
        return BenchmarkItem(
            benchmark, task, row.number, row.text("context"), template.format(input=_template_input(row, template)),
            answers, metric, max_new, length=length,
            bucket=longbench_e_bucket(length) if benchmark == "longbench-e" else None, first_line_only=first_line,
            extra=_classes(row, task, answers) if metric == "classification" else (), source=row.source,
        )

    return parse


def _option_lines(options: tuple[str, ...]) -> str:
    return "\n".join(f"{letter}. {text}" for letter, text in zip(OPTION_LETTERS, options))


def _parse_infinitebench(row: _Row) -> BenchmarkItem:
    task = row.file.stem
    if task not in INFINITEBENCH_TASKS:
        raise ValueError(f"{row.file}: InfiniteBench task {task!r} (the file name) is unknown; known: {sorted(INFINITEBENCH_TASKS)}")
    metric, max_new, template = INFINITEBENCH_TASKS[task]
    options = row.strings("options")
    answers = row.answers("answer")
    extra: tuple = ()
    if metric == "option_choice":
        if len(options) > len(OPTION_LETTERS):
            raise row.error("options", f"must hold at most {len(OPTION_LETTERS)} options (lettered {OPTION_LETTERS[0]} to "
                            f"{OPTION_LETTERS[-1]}), got {len(options)}")
        if answers[0] not in options:
            raise row.error("answer", f"must be one of the options {list(options)}, got {answers[0]!r}")
        extra = (("options", options),)
    question = template.format(input=_template_input(row, template), options=_option_lines(options))
    return BenchmarkItem("infinitebench", task, row.number, row.text("context"), question, answers, metric, max_new,
                         extra=extra, source=row.source)


def _parse_kvpress(row: _Row) -> BenchmarkItem:
    task = row.text("task")
    # kvpress keeps RULER's and InfiniteBench's `answer` and LongBench's own `answers`
    answers = row.answers("answers" if "answer" not in row.data and "answers" in row.data else "answer")
    extra: tuple = ()
    first_line = False
    if task.removesuffix("_e") in LONGBENCH_TASKS:
        metric, _, _, first_line = LONGBENCH_TASKS[task.removesuffix("_e")]
        if metric == "classification":
            extra = _classes(row, task, answers)
    elif task in INFINITEBENCH_TASKS:
        metric = INFINITEBENCH_TASKS[task][0]
        if metric == "option_choice":
            raise row.error("task", f"{task!r}: kvpress keeps only the letter of multiple-choice answers; use --benchmark infinitebench")
    else:
        metric = _ruler_family(task, row)[0] if _ruler_family_of(task) is not None else None
        if metric is None:
            raise row.error("task", f"{task!r} is not a RULER, LongBench or InfiniteBench task name, so it has no metric")
    max_new = row.integer("max_new_tokens")
    if max_new < 1:
        raise row.error("max_new_tokens", f"must be >= 1, got {max_new}")
    return BenchmarkItem("kvpress", task, row.number, row.text("context"), row.text("question", optional=True),
                         answers, metric, max_new, answer_prefix=row.text("answer_prefix", optional=True),
                         first_line_only=first_line, extra=extra, length=row.integer("length", optional=True), source=row.source)


_PARSERS = {
    "ruler": _parse_ruler,
    "longbench": _longbench_parser("longbench"),
    "longbench-e": _longbench_parser("longbench-e"),
    "infinitebench": _parse_infinitebench,
    "kvpress": _parse_kvpress,
}
_ANSWER_FIELDS = {"ruler": "outputs", "longbench": "answers", "longbench-e": "answers", "infinitebench": "answer", "kvpress": "answer"}

