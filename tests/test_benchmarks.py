"""Standard benchmark loaders on fixture files in the published schemas, their metrics on hand-worked
cases, the leaderboard, and `kvcompress eval --benchmark` on a tiny random model. Also the repository's
own benchmarks/: every benchmarks/ or results/ path the README and docs/ cite exists, and docs/bench.md
describes every script."""

import json
import re
import sys
from pathlib import Path

import pytest

from kvcompress.cli import main
from kvcompress.eval import metrics
from kvcompress.eval.benchmarks import load_benchmark, longbench_e_bucket
from kvcompress.eval.leaderboard import leaderboard, markdown_leaderboard
from kvcompress.eval.stats import wilson
from kvcompress.eval.runner import FULL, read_results

FIXTURES = Path(__file__).parent / "fixtures"


def by_task(items):
    out = {}
    for item in items:
        out.setdefault(item.task, []).append(item)
    return out


def test_ruler_loader_splits_the_question_off_and_keeps_the_answer_prefix():
    items = by_task(load_benchmark("ruler", FIXTURES / "ruler"))
    assert sorted(items) == ["niah_single_1", "qa_1"]
    first, second = items["niah_single_1"]
    row = json.loads((FIXTURES / "ruler/4096/data/niah_single_1/validation.jsonl").read_text().splitlines()[0])
    assert first.context + "\n" + first.question == row["input"]
    assert first.question == "What is the special magic number for fancy-tree mentioned in the provided text?"
    assert first.answer_prefix == " The special magic number for fancy-tree mentioned in the provided text is"
    assert (first.answers, first.length, first.index, second.index) == (("1234567",), 96, 0, 1)
    assert (first.metric, first.max_new_tokens) == ("string_match_all", 128)
    qa = items["qa_1"][0]
    assert qa.question == "Question: What is the capital of France?"
    assert (qa.metric, qa.max_new_tokens, qa.answers) == ("string_match_part", 32, ("Paris", "City of Paris"))
    # string-match-all: one of two values found; string-match-part: any answer, case-insensitive
    assert second.score(" 7654321 and 1111111.") == 0.5
    assert second.score("5555555, 7654321") == 1.0
    assert qa.score("paris.") == 1.0 and qa.score("London") == 0.0


def test_longbench_loader_fields_metrics_and_answer_lengths():
    items = by_task(load_benchmark("longbench", FIXTURES / "longbench"))
    assert sorted(items) == ["hotpotqa", "multifieldqa_zh", "passage_retrieval_en", "trec"]  # hotpotqa_e.jsonl is LongBench-E's
    hotpot = items["hotpotqa"][1]
    assert hotpot.context.startswith("Passage 1:\nThe Eiffel Tower") and "Who built the Eiffel Tower?" in hotpot.question
    assert (hotpot.metric, hotpot.max_new_tokens, hotpot.length, hotpot.bucket) == ("qa_f1", 32, 21, None)
    # best over the answers: "eiffels company built it" vs "eiffels company" -> P 2/4, R 1 -> F1 2/3;
    # vs "company of gustave eiffel" only "company" is shared -> 1/4
    assert hotpot.score("Eiffel's company built it") == pytest.approx(2 / 3)
    trec = items["trec"][0]
    assert (trec.metric, trec.max_new_tokens, trec.first_line_only) == ("classification", 64, True)
    assert dict(trec.extra)["all_classes"] == ("Individual", "City", "Other location", "Country")
    assert trec.score("Other location\nQuestion: Who is there ?\nType: Individual") == 1.0  # first line only
    assert trec.score("City or Other location") == 0.5
    assert items["passage_retrieval_en"][0].score("Paragraph 2, not Paragraph 1") == 0.5
    zh = items["multifieldqa_zh"][0]
    assert (zh.metric, zh.max_new_tokens) == ("qa_f1_zh", 64) and zh.question.startswith("请根据上文回答问题")


def test_longbench_e_buckets():
    items = load_benchmark("longbench-e", FIXTURES / "longbench")
    assert [(i.task, i.length, i.bucket) for i in items] == [
        ("hotpotqa", 3500, "0-4k"), ("hotpotqa", 6000, "4-8k"), ("hotpotqa", 9500, "8k+"), ("hotpotqa", 120, "0-4k")]
    assert [longbench_e_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]


def test_infinitebench_loader_and_metrics():
    items = by_task(load_benchmark("infinitebench", FIXTURES / "infinitebench"))
    passkey, kv, choice = items["passkey"][0], items["kv_retrieval"][0], items["longbook_choice_eng"][0]
    assert (passkey.metric, passkey.max_new_tokens, passkey.answers) == ("first_integer_match", 6, ("71432",))
    assert passkey.question == "What is the pass key?\n\nThe pass key is"
    assert passkey.score(" 71432.") == 1.0 and passkey.score("7143 2") == 0.0
    assert (kv.max_new_tokens, kv.score('"0c3d-value".'), kv.score("0c3d-value-x")) == (50, 1.0, 0.0)
    assert "\nA. To the city\nB. To the island\nC. Home\nD. Nowhere\n" in choice.question
    assert [choice.score(p) for p in ("B", "The answer is B. To the island", "A", "To the island", "Home")] == [1, 1, 0, 1, 0]
    # read in InfiniteBench's order: the letter it starts with, then what follows an answer phrase, then the first letter
    assert [choice.score(p) for p in ("B. Because option A is wrong.", "Alice sails. The answer is: B", "Answer: (B)",
                                      "The answer is C, not B", "I think A, or B", "Bob says B", "The option is to the island")
            ] == [1, 1, 1, 0, 0, 1, 0]


def test_kvpress_parquet_loader_picks_each_tasks_metric():
    items = load_benchmark("kvpress", FIXTURES / "kvpress/test.parquet")
    assert [(i.task, i.metric, i.max_new_tokens) for i in items] == [
        ("niah_single_2", "string_match_all", 128), ("hotpotqa", "qa_f1", 32), ("passage_count", "count", 32)]
    assert items[0].answer_prefix == " The special magic number for old-bridge is"
    assert items[1].question == "Answer briefly. In which year was the tower finished?"
    assert items[2].score("There are 2 paragraphs, not 3") == 0.5


def test_tasks_and_limit_select_items():
    items = load_benchmark("ruler", FIXTURES / "ruler", tasks=["niah_single_1"], limit=1)
    assert [(i.task, i.index) for i in items] == [("niah_single_1", 0)]
    with pytest.raises(ValueError, match=r"tasks \['nope'\] have no samples"):
        load_benchmark("ruler", FIXTURES / "ruler", tasks=["nope"])


def test_longbench_qa_f1_on_punctuation_and_articles():
    f1 = metrics.METRICS["qa_f1"]
    # "the eiffel tower, in paris!" -> [eiffel, tower, in, paris] vs [eiffel, tower]: P 1/2, R 1
    assert f1("The Eiffel Tower, in Paris!", ["Eiffel tower"]) == pytest.approx(2 / 3)
    assert f1("an apple", ["the apple"]) == 1.0
    assert f1("Anthem", ["anthem"]) == 1.0  # "an" is removed only as a whole word
    assert f1("U.S.A.", ["USA"]) == 1.0
    assert f1("the", ["a"]) == 0.0  # both normalise to nothing
    assert f1("new york new york", ["new york new york"]) == 1.0  # overlap counts repeated words (a multiset), not a set
    assert f1("york york", ["new york"]) == pytest.approx(0.5)  # one "york" in common: P 1/2, R 1/2


def test_ruler_substring_metrics_ignore_case():
    assert metrics.METRICS["string_match_all"]("The words are APPLE and Pear.", ["apple", "pear"]) == 1.0
    assert metrics.METRICS["string_match_all"]("apple only", ["Apple", "pear"]) == 0.5
    assert metrics.METRICS["string_match_part"]("PARIS", ["paris", "lyon"]) == 1.0
    assert metrics.normalize_answer("  The  cat's   hat.  ") == "cats hat"


def test_longbench_chinese_metrics():
    # jieba: 长江/流经/武汉/，/然后/到/南京/。 -> 6 words after dropping punctuation; truth 武汉/和/南京
    assert metrics.METRICS["qa_f1_zh"]("长江流经武汉，然后到南京。", ["武汉和南京"]) == pytest.approx(2 * (2 / 6) * (2 / 3) / (2 / 6 + 2 / 3))
    assert metrics.normalize_zh_answer("武汉， 南京！ OK.") == "武汉南京ok"
    # ROUGE-L on jieba words: 武汉/和/南京 vs 南京/和/武汉, longest common subsequence 1 of 3
    assert metrics.METRICS["rouge_l_zh"]("武汉和南京", ["南京和武汉"]) == pytest.approx(1 / 3)
    assert metrics.METRICS["retrieval_zh"]("答案是段落2", ["段落2"]) == 1.0
    # InfiniteBench's Chinese F1 counts characters: 武汉 vs 武汉和南京 -> P 1, R 2/5
    assert metrics.METRICS["qa_f1_zh_chars"]("武汉", ["武汉和南京"]) == pytest.approx(4 / 7)


def test_longbench_other_metrics():
    # ROUGE-L: the/cat/sat/on/the/mat vs the/cat/is/on/the/mat, LCS 5 of 6 each way; punctuation dropped
    assert metrics.METRICS["rouge_l"]("The cat, sat on the mat.", ["the cat is on the mat"]) == pytest.approx(5 / 6)
    classes = {"all_classes": ("location", "Other location", "City")}
    assert metrics.classification("Other location", "Other location", **classes) == 1.0  # 'location' inside the truth is no second guess
    assert metrics.classification("location", "Other location", **classes) == 0.0
    assert metrics.classification("City, Other location", "Other location", **classes) == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        metrics.classification("City", "City")
    assert metrics.METRICS["count"]("There are 3 unique paragraphs out of 5", ["3"]) == 0.5
    assert metrics.METRICS["retrieval"]("none", ["Paragraph 4"]) == 0.0
    code = metrics.METRICS["code_similarity"]
    assert code("```python\n# the next line\nreturn x + 1\n```", ["return x + 1"]) == 1.0
    assert code("return x+1", ["return x + 1"]) == pytest.approx(20 / 22)  # Indel: 2 * 10 shared / (10 + 12)


def test_infinitebench_number_metrics():
    assert metrics.number_prefix("3, 5, 8, 9", ["3", "5", "9"]) == pytest.approx(2 / 3)
    assert metrics.last_word_integer("The return value is: 42", ["42"]) == 1.0
    assert metrics.last_word_integer("42 is not it", ["42"]) == 0.0
    assert metrics.first_number_match("It is 3.5 or 4", ["3.5"]) == 1.0
    assert metrics.contains_upper("it was ana", ["ANA"]) == 1.0


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_malformed_files_name_file_row_and_field(tmp_path):
    good = {"input": "context\nquestion?", "outputs": ["1"], "length": 5}
    bad_json = tmp_path / "niah_a.jsonl"
    bad_json.write_text(json.dumps(good) + "\n{\"input\": \"x\n")
    with pytest.raises(ValueError, match=r"niah_a.jsonl: row 1: not valid JSON"):
        load_benchmark("ruler", bad_json)
    missing = write_rows(tmp_path / "niah_b.jsonl", [good, {"input": "c\nq", "length": 3, "outputs": None}])
    with pytest.raises(ValueError, match=r"niah_b.jsonl: row 1: field 'outputs' is missing"):
        load_benchmark("ruler", missing)
    no_question = write_rows(tmp_path / "niah_c.jsonl", [good | {"input": "no line break"}])
    with pytest.raises(ValueError, match=r"niah_c.jsonl: row 0: field 'input' must end with the question"):
        load_benchmark("ruler", no_question)
    trec = write_rows(tmp_path / "trec.jsonl", [{"context": "c", "input": "q", "answers": ["A"], "length": 2, "dataset": "trec", "all_classes": None}])
    with pytest.raises(ValueError, match=r"trec.jsonl: row 0: field 'all_classes'"):
        load_benchmark("longbench", trec)
    with pytest.raises(ValueError, match="does not exist"):
        load_benchmark("longbench", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="benchmark must be one of"):
        load_benchmark("mmlu", tmp_path)


def test_cli_reports_a_bad_data_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "niah_x.jsonl"
    bad.write_text('{"input": "c\\nq", "outputs": ["1"], "length": 3}\nnot json\n')
    assert main(["eval", "--benchmark", "ruler", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "niah_x.jsonl: row 1: not valid JSON" in err
    assert main(["eval", "--benchmark", "ruler", "--data", str(bad), "--lengths", "100"]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_leaderboard_values_and_intervals():
    assert wilson(3, 4) == pytest.approx((0.3006, 0.9544), abs=1e-4)

    def rec(method, ratio, task, index, score):
        return {"benchmark": "ruler", "method": method, "ratio": ratio, "mode": "-" if method == FULL else "prefill",
                "task": task, "index": index, "bucket": None, "error": None, "score": score}

    records = [rec(FULL, None, "a", i, s) for i, s in enumerate([1, 1, 0, 1])] + [rec(FULL, None, "b", 0, 0.5), rec(FULL, None, "b", 1, 0.7)]
    records += [rec("knorm", 0.5, "a", i, 0) for i in range(4)] + [rec("knorm", 0.5, "b", 0, 0.2)]
    records.append(rec("knorm", 0.5, "b", 1, None) | {"error": "ValueError: too small"})
    columns, entries, cells = leaderboard(records)
    assert columns == ["average", "a", "b"] and entries == [(FULL, None, "-"), ("knorm", 0.5, "prefill")]
    full = (FULL, None, "-")
    assert cells[(full, "a")]["mean"] == 0.75 and cells[(full, "b")]["mean"] == pytest.approx(0.6)
    # b: mean 0.6, s = 0.1414, se = 0.1, interval 0.6 -/+ 1.96 * 0.1
    assert (cells[(full, "b")]["low"], cells[(full, "b")]["high"]) == pytest.approx((0.6 - 0.196, 0.6 + 0.196), abs=1e-3)
    assert cells[(full, "average")]["mean"] == pytest.approx(0.675)
    lines = markdown_leaderboard("ruler", records).splitlines()
    assert lines[2] == "| method @ ratio | average | a | b |"
    assert lines[4].startswith("| full cache | 67.5 [") and "| 75.0 [30.1, 95.4] |" in lines[4]
    # knorm: task b has one non-binary score left (the other errored): no interval, flagged, and so is the average
    assert lines[5] == "| knorm @ 0.5 | 10.0* (n=5, no interval) | 0.0 [0.0, 49.0] | 20.0* (n=1, no interval) |"


def test_cli_benchmark_sweep_scores_with_the_benchmark_metric(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["eval", "--benchmark", "longbench", "--data", str(FIXTURES / "longbench"), "--tasks", "hotpotqa,trec",
            "--model", str(tiny_checkpoint), "--methods", "knorm", "--ratios", "0.2", "--max-new-tokens", "3", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    records = read_results(out / "results.jsonl")
    items = {(i.task, i.index): i for i in load_benchmark("longbench", FIXTURES / "longbench", tasks=["hotpotqa", "trec"])}
    assert len(records) == len(items) * 2 and {r["method"] for r in records} == {FULL, "knorm"}
    for r in records:
        assert r["error"] is None and r["benchmark"] == "longbench" and r["key"].startswith("longbench|")
        assert r["score"] == items[(r["task"], r["index"])].score(r["prediction"])
    md = (out / "leaderboard_longbench.md").read_text()
    assert "| method @ ratio | average | hotpotqa | trec |" in md and "| knorm @ 0.2 |" in md
    assert "<table>" in (out / "leaderboard_longbench.html").read_text()
    assert (out / "leaderboard_longbench.png").stat().st_size > 1000
    assert "### longbench" in capsys.readouterr().out
    assert main(args) == 0  # resumed: nothing left to do, nothing recorded twice
    assert len(read_results(out / "results.jsonl")) == len(records)


def test_sweep_config_with_a_benchmark_rejects_generated_task_settings():
    from kvcompress.eval.runner import SweepConfig

    config = SweepConfig(benchmark="ruler", data=str(FIXTURES / "ruler"), samples=None, methods=["knorm"])
    assert config.tasks is None and config.samples is None
    for kw, name in [({"benchmark": "mmlu", "data": "x"}, "benchmark"), ({"benchmark": "ruler"}, "data"),
                     ({"benchmark": "ruler", "data": "x", "lengths": [512]}, "lengths"),
                     ({"benchmark": "ruler", "data": "x", "haystack": "prose"}, "haystack"),
                     ({"samples": None}, "samples")]:
        with pytest.raises(ValueError, match=name):
            SweepConfig(**kw)


@pytest.mark.e2e
@pytest.mark.smoke
def test_default_model_answers_the_ruler_fixture(default_model, tmp_path):
    """The question split off RULER's input and the answer prefix reach the real model: it finds the needle."""
    from kvcompress.eval.runner import SweepConfig, run_sweep

    model, tokenizer = default_model
    config = SweepConfig(benchmark="ruler", data=str(FIXTURES / "ruler"), tasks=["niah_single_1"], samples=1,
                         methods=["streamingllm"], ratios=[0.2], max_new_tokens=12)
    records = run_sweep(model, tokenizer, config, tmp_path, progress=False)
    assert [(r["method"], r["score"]) for r in records] == [(FULL, 1.0), ("streamingllm", 1.0)]
    assert all(r["prediction"].startswith("1234567") for r in records)


# --- the repository's own benchmarks/ folder: what the docs cite exists, and every script is documented ---

REPO = Path(__file__).resolve().parent.parent
CITED_PATH = re.compile(r"(?:(?<=\.\./)|(?<![\w/.-]))((?:benchmarks|results)/[\w.{},*/-]*)")


def _script(relative: str):
    """The benchmark script at `relative` (under benchmarks/) imported as a module of its own name (in sys.modules, where a
    dataclass reads its module), its folder on the path while it imports its neighbours."""
    import importlib.util
    import sys

    path = REPO / "benchmarks" / relative
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for option in match.group(1).split(",") for p in _expand_braces(path[: match.start()] + option + path[match.end():])]


def cited_paths(text: str) -> list[str]:
    """benchmarks/... and results/... paths a document cites, braces expanded; output folders of commands (--out, --csv) left out."""
    out = []
    for match in CITED_PATH.finditer(text):
        if re.search(r"--(out|csv)[ =]$", text[max(0, match.start() - 6): match.start()]):
            continue
        path = match.group(1).rstrip(".,:;")
        out += _expand_braces(path)
    return out


def test_cited_paths_are_found_in_text():
    text = ("see `benchmarks/results/many_questions.md`, ![x](../results/sweep_4k/a.png) and "
            "results/eval_hybrid/approx_span_text{0,2}/; kvcompress eval --out results/lb; docs/results.md; "
            "kvcompress/eval/benchmarks.py; benchmarks/tuning/*.py.")
    assert cited_paths(text) == ["benchmarks/results/many_questions.md", "results/sweep_4k/a.png", "results/eval_hybrid/approx_span_text0/",
                                 "results/eval_hybrid/approx_span_text2/", "benchmarks/tuning/*.py"]


@pytest.mark.parametrize("doc", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))])
def test_every_benchmark_script_and_result_a_document_cites_exists(doc):
    missing = [p for p in cited_paths((REPO / doc).read_text(encoding="utf-8")) if not any(REPO.glob(p.rstrip("/")))]
    assert not missing, f"{doc} cites paths that do not exist: {sorted(set(missing))}"


def test_every_benchmark_script_is_documented_in_bench_md_and_compiles():
    bench_md = (REPO / "docs" / "bench.md").read_text(encoding="utf-8")
    scripts = sorted((REPO / "benchmarks").rglob("*.py"))
    assert scripts
    for script in scripts:
        assert f"`{script.name}`" in bench_md, f"docs/bench.md does not describe benchmarks/{script.relative_to(REPO / 'benchmarks')}"
        compile(script.read_text(encoding="utf-8"), str(script), "exec")


def test_scorer_inputs_neighbours_and_top_share_on_hand_worked_cases():
    """benchmarks/tuning/scorer_inputs.py: a token's neighbours' rows, and the share of the target's top-k the prediction
    ranks there too."""
    import torch

    module = _script("tuning/scorer_inputs.py")
    x = torch.arange(8.0).reshape(4, 2)
    assert module.shifted(x, 1).tolist() == [[2, 3], [4, 5], [6, 7], [0, 0]]
    assert module.shifted(x, -1).tolist() == [[0, 0], [0, 1], [2, 3], [4, 5]]
    assert torch.equal(module.shifted(x, 0), x)
    assert module.neighbours(x, 0, [4])[1].tolist() == [0, 1, 2, 3, 4, 5]
    target = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    assert module.top_share(target, target, 0.5) == 1.0
    assert module.top_share(-target, target, 0.5) == 0.0
    # head 0 ranks {0, 2} where the target's top half is {0, 1}: one of two; head 1 gets both
    predicted = torch.tensor([[4.0, 1.0, 3.0, 2.0], [0.0, 0.0, 5.0, 6.0]])
    assert module.top_share(predicted, target, 0.5) == 0.75


def test_scorer_inputs_context_features_restart_with_each_context():
    """benchmarks/tuning/scorer_inputs.py's context features on a one-head layer whose key and value projections are the
    identity: log norms, and the cosine of each key with its context's running mean key (1 for a context's first token)."""
    import math
    from types import SimpleNamespace

    import torch

    module = _script("tuning/scorer_inputs.py")
    identity = torch.nn.Linear(2, 2, bias=False)
    identity.weight.data = torch.eye(2)
    layer = SimpleNamespace(self_attn=SimpleNamespace(k_proj=identity, v_proj=identity))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]), config=SimpleNamespace(num_key_value_heads=1))
    hidden = torch.tensor([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]])  # contexts of 2 and 1 tokens
    out = module.context_features(model, hidden, 0, [2, 1], ("norms", "cosine"))
    assert out.shape == (3, 2 + 3) and torch.equal(out[:, :2], hidden)
    assert torch.allclose(out[:, 2], torch.tensor([math.log(5.0), 0.0, 0.0])) and torch.equal(out[:, 2], out[:, 3])
    # token 1's running mean key is (1.5, 2.5): cosine 2.5 / sqrt(8.5); each context's first token has cosine 1
    assert torch.allclose(out[:, 4], torch.tensor([1.0, 2.5 / math.sqrt(8.5), 1.0]))
    assert module.context_features(model, hidden, 0, [2, 1], ()).shape == (3, 2)


def test_needle_keep_spans_and_summary_on_hand_worked_cases(tmp_path):
    """benchmarks/tuning/needle_keep.py: the answer's tokens and the fact's words before it (back to the last full stop),
    and the summary's split of the full cache's hits by whether the variant found them."""
    import json

    module = _script("tuning/needle_keep.py")

    class Words:  # one token per word; a word's text is its own
        vocab = ["It", "rained.", "The", "key", "was", "near", "Ludlow", "Castle", "today."]

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [self.vocab.index(w) for w in text.split()]}

        def decode(self, ids):
            return " ".join(self.vocab[i] for i in ids)

    ids = Words()("It rained. The key was near Ludlow Castle today.")["input_ids"]
    answer, fact = module.needle_spans(Words(), ids, "Ludlow Castle")
    assert (answer, fact) == (range(6, 8), range(2, 6))
    with pytest.raises(ValueError, match="not among"):
        module.needle_spans(Words(), ids, "Castle Ludlow")
    hits = [{"variant": "full", "seed": s, "length": 8, "ratio": 0.0, "hit": h} for s, h in ((1, 1.0), (2, 1.0), (3, 0.0))]
    hits += [{"variant": "v", "seed": s, "length": 8, "ratio": 0.9, "hit": h} for s, h in ((1, 1.0), (2, 0.0), (3, 1.0))]
    rows = [{"variant": "v", "seed": s, "length": 8, "ratio": 0.9, "in_window": False, "answer_share_min": m, "answer_share_mean": m,
             "fact_share_mean": 0.1, "context_share_mean": 0.1} for s, m in ((1, 0.5), (2, 0.05), (3, 0.9))]
    (tmp_path / "hits.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hits))
    (tmp_path / "keep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = module.summary_rows(tmp_path / "keep.jsonl", tmp_path / "hits.jsonl")  # needle 3: the full cache misses it
    assert [(r["needle"], r["needles"], r["least kept answer token"]) for r in summary] == [("found", 1, 0.5), ("missed", 1, 0.05)]
    rows[0]["in_window"] = True  # a needle in the exact window is counted apart, its shares left out
    (tmp_path / "keep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = module.summary_rows(tmp_path / "keep.jsonl", tmp_path / "hits.jsonl")[0]
    assert (found["in the window"], found["least kept answer token"]) == (1, "–")


def test_needle_oracle_forces_the_chosen_positions_above_every_score_and_registers_nothing_on_import():
    """benchmarks/tuning/needle_oracle.py: each variant's forced positions, and ForcedKVzap's scores: the surrogate's, with
    the forced positions raised to FORCED_SCORE in every head; importing the script registers no method."""
    import torch

    import kvcompress as kvc
    from kvcompress.methods.tokens import Tokens
    from test_kvzap import _surrogate

    module = _script("tuning/needle_oracle.py")
    assert module.ForcedKVzap.name not in kvc.methods()
    answer, fact = range(6, 8), range(2, 6)
    assert module.forced_positions("forced_none", answer, fact) == ()
    assert module.forced_positions("forced_answer", answer, fact) == (6, 7)
    assert module.forced_positions("forced_answer_fact", answer, fact) == (2, 3, 4, 5, 6, 7)
    with pytest.raises(ValueError, match="forced_answer"):
        module.forced_positions("full", answer, fact)
    surrogate = _surrogate(layers=(0,), width=16)
    method = module.ForcedKVzap.__new__(module.ForcedKVzap)  # the test surrogate in place of the shipped one
    method.scorer, method.threshold, method.surrogate, method.forced = "test", None, surrogate, (3, 7)
    hidden = torch.randn(1, 2, 10, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.stack([torch.arange(10), torch.arange(10).flip(0)])[None]  # the heads hold the tokens in other orders
    tokens = Tokens(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), positions, layer_idx=0, num_layers=1, hidden_states=hidden)
    scores, predicted = method.score(tokens, None), surrogate.predict(hidden, 0)
    forced = (positions == 3) | (positions == 7)
    assert bool((scores[forced] == module.FORCED_SCORE).all()) and torch.equal(scores[~forced], predicted[~forced])
    assert bool((predicted < module.FORCED_SCORE).all())


@pytest.mark.e2e
@pytest.mark.smoke
def test_default_cost_divides_each_cell_by_plain_generates_of_its_own(default_model, tmp_path, monkeypatch):
    """benchmarks/default_cost.py on the default model (`--pairing cell`, every cell in one process): each cell's timed
    answers alternate with plain generates of their own, after its untimed pair; its over_plain is its median over the
    median of those (`plain_s`), and the `plain` row is the median of every timed plain generate."""
    import csv
    import statistics
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import default_cost
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    model, tokenizer = default_model
    calls, answering = [], []
    generate, answer = model.generate, default_cost.kvc.generate

    def plain(*args, **kwargs):  # a plain generate, not kvc.generate's own decoding
        if not answering:
            calls.append("plain")
        return generate(*args, **kwargs)

    def compressed(*args, **kwargs):
        calls.append(kwargs["mode"])
        answering.append(True)
        try:
            return answer(*args, **kwargs)
        finally:
            answering.pop()

    monkeypatch.setattr(model, "generate", plain)
    monkeypatch.setattr(default_cost.kvc, "generate", compressed)
    monkeypatch.setattr(default_cost.kvc, "load_model", lambda: default_model)
    out = tmp_path / "cost.csv"
    monkeypatch.setattr(sys, "argv", ["default_cost.py", "--lengths", "192", "--modes", "prefill,chunked", "--ratios", "0.5",
                                      "--repeats", "2", "--warmup", "1", "--new-tokens", "2", "--pairing", "cell", "--out", str(out)])
    default_cost.main()
    assert calls == ["plain", "prefill"] * 3 + ["plain", "chunked"] * 3
    rows = list(csv.DictReader(out.open()))
    assert [(r["method"], r["mode"]) for r in rows] == [("plain", "generate"), ("default", "prefill"), ("default", "chunked")]
    for row in rows[1:]:
        assert row["pairing"] == "cell" and float(row["over_plain"]) == pytest.approx(float(row["median_s"]) / float(row["plain_s"]), abs=2e-3)
        assert 0 < float(row["kv_over_full"]) < 1
    assert float(rows[0]["plain_s"]) >= min(float(r["plain_s"]) for r in rows[1:]) - 1e-3
    assert float(rows[0]["plain_s"]) <= max(float(r["plain_s"]) for r in rows[1:]) + 1e-3


@pytest.mark.e2e
@pytest.mark.smoke
def test_default_cost_measures_each_cell_in_a_fresh_process_by_default(default_model, tmp_path, monkeypatch):
    """benchmarks/default_cost.py's default `--pairing process`: one command line of this script per cell (`--pairing
    cell`, that cell alone), each row that cell's, and the `plain` row the median of the cells' plain medians. The
    children's command lines run here, in this process (a fresh process each costs some 6 s of imports and loading)."""
    import csv
    import statistics
    import sys

    default_cost = _script("default_cost.py")
    children = []

    def child(argv, check):  # what the fresh process runs: this script's main() on its command line
        assert argv[:2] == [sys.executable, default_cost.__file__] and check
        children.append(argv[argv.index("--modes") + 1])
        monkeypatch.setattr(sys, "argv", ["default_cost.py", *argv[2:]])
        default_cost.main()

    monkeypatch.setattr(default_cost.subprocess, "run", child)
    monkeypatch.setattr(default_cost.kvc, "load_model", lambda: default_model)
    out = tmp_path / "cost.csv"
    monkeypatch.setattr(sys, "argv", ["default_cost.py", "--lengths", "160", "--modes", "prefill,decode", "--ratios", "0.5",
                                      "--repeats", "1", "--warmup", "0", "--new-tokens", "2", "--out", str(out)])
    default_cost.main()
    assert children == ["prefill", "decode"]
    rows = list(csv.DictReader(out.open()))
    assert [r["mode"] for r in rows] == ["generate", "prefill", "decode"]
    assert all(r["pairing"] == "process" for r in rows)
    assert float(rows[0]["plain_s"]) == pytest.approx(statistics.median(float(r["plain_s"]) for r in rows[1:]), abs=1e-3)


def test_refit_cost_times_kvzip_refits_on_small_synthetic_layers():
    """benchmarks/refit_cost.py builds `kvzip_refit`'s AdaKV from its named settings (a scorer by name) and times one
    allocation and both ways of forming the refit's normalisers."""
    refit_cost = _script("refit_cost.py")
    layers = [refit_cost.layer_tokens(96, 2, 2, 16, seed) for seed in range(2)]
    row = refit_cost.measure(layers, 0.75, 0, "log_weights")
    assert row["scoring_s"] >= 0 and row["refit_handed_s"] > 0 and row["refit_formed_s"] > 0


def test_quantized_storage_needle_rows_pair_each_cell_with_full_precision():
    """benchmarks/quantized_storage.py --task needle: each cell's accuracy, paired with the same method and ratio at the
    run's full precision."""
    quantized_storage = _script("quantized_storage.py")
    grid = [("keydiff", 0.5, 32), ("keydiff", 0.5, 4)]
    scores = {grid[0]: [1.0, 1.0, 0.0, 1.0], grid[1]: [1.0, 0.0, 0.0, 1.0]}
    rows = quantized_storage.needle_rows(grid, scores, {cell: [0.5] * 4 for cell in grid}, 32)
    assert [(r["bits"], r["accuracy"], r["vs_full_precision"]) for r in rows] == [(32, 0.75, 0.0), (4, 0.5, -0.25)]


def test_compare_runs_reads_committed_folders_and_refuses_empty_ones(tmp_path):
    """benchmarks/tuning/compare_runs.py tasks: a committed eval folder (results.jsonl.gz) against itself pairs every
    answered cell with no change; a folder with no records is an error naming it, not an empty table."""
    compare_runs = _script("tuning/compare_runs.py")
    table = compare_runs.tasks_table(REPO / "results" / "sweep_2k", REPO / "results" / "sweep_2k")
    assert "| balancekv @ 0.5 (prefill) | 60 | 50 (38–62) | 50 (38–62) | 0 | 0 | 1.00 |" in table
    with pytest.raises(SystemExit, match="holds no kvcompress eval records"):
        compare_runs.tasks_table(tmp_path, REPO / "results" / "sweep_2k")
    # two runs that built one sample from different prompts (another Python's text) do not pair
    record = {"method": "knorm", "ratio": 0.5, "mode": "prefill", "task": "niah_single", "length": 200, "index": 0, "depth": 0.5,
              "error": None, "score": 1.0, "grid": False}
    for name, digest in (("a", "a" * 64), ("b", "b" * 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.jsonl").write_text(json.dumps(record | {"prompt_sha256": digest}) + "\n")
    with pytest.raises(SystemExit, match=r"/a and .*/b: the records of sample \{'task': 'niah_single', 'length': 200, 'index': 0, "
                                         r"'depth': 0.5\} answered two prompts"):
        compare_runs.tasks_table(tmp_path / "a", tmp_path / "b")
    assert "| knorm @ 0.5 (prefill) | 1 |" in compare_runs.tasks_table(tmp_path / "a", tmp_path / "a")


def test_code_run_scores_any_last_word_without_raising():
    """InfiniteBench's code_run reads the last word as an integer: a word int() refuses scores 0 (its script's failed
    int()), one it takes ('+5') is compared by value."""
    for prediction, score in (("The return value is --5", 0.0), ("The return value is 5²", 0.0), ("It is ⑤", 0.0),
                              ("The return value is +5", 1.0), ("value: -5", 0.0), ("", 0.0)):
        assert metrics.last_word_integer(prediction, ["5"]) == score, prediction
    assert metrics.last_word_integer("value: -5", ["-5"]) == 1.0


@pytest.mark.parametrize(("benchmark", "file", "row", "field", "problem"), [
    ("longbench", "passage_retrieval_en.jsonl", {"context": "c", "input": "q", "answers": ["Para 3"], "length": 2,
                                                "dataset": "passage_retrieval_en", "all_classes": None}, "answers", "must name its paragraph as"),
    ("infinitebench", "math_find.jsonl", {"context": "c", "input": "q", "answer": "abc"}, "answer", "must be a number, got 'abc'"),
    ("infinitebench", "code_run.jsonl", {"context": "c", "input": "q", "answer": "x"}, "answer", "must be an integer, got 'x'"),
    ("infinitebench", "math_calc.jsonl", {"context": "c", "input": "q", "answer": [1.5, 2]}, "answer", "must be an integer, got '1.5'"),
    ("ruler", "niah_a.jsonl", {"input": "context\nquestion?", "outputs": [""], "length": 5}, "outputs", "must not hold an empty answer"),
    ("infinitebench", "passkey.jsonl", {"context": "c", "input": "q", "answer": " "}, "answer", "must not hold an empty answer"),
    # answers that could never score: a count or a first integer that is none, a bool, a class not among the classes,
    # an eleventh option (lettered past J), a dataset name that is no text (an AttributeError before)
    ("longbench", "passage_count.jsonl", {"context": "c", "input": "q", "answers": [5.0], "length": 2}, "answers",
     "must be an integer, got '5.0'"),
    ("infinitebench", "passkey.jsonl", {"context": "c", "input": "q", "answer": "seventy"}, "answer", "must be an integer"),
    ("infinitebench", "passkey.jsonl", {"context": "c", "input": "q", "answer": [True]}, "answer", "must be a non-empty list"),
    ("longbench", "trec.jsonl", {"context": "c", "input": "q", "answers": ["Z"], "length": 2, "all_classes": ["A", "B"]},
     "all_classes", r"must hold every answer \(one missing always scores 0\), lacks \['Z'\]"),
    ("infinitebench", "longbook_choice_eng.jsonl", {"context": "c", "input": "q", "answer": "o10", "options": [f"o{i}" for i in range(11)]},
     "options", "must hold at most 10 options"),
    ("longbench", "trec.jsonl", {"context": "c", "input": "q", "answers": ["A"], "length": 2, "dataset": 5}, "dataset", "must be text, got int"),
    # a question template that places the input, without the field, asked an empty question
    ("longbench", "hotpotqa.jsonl", {"context": "c", "answers": ["A"], "length": 2}, "input", "is missing"),
    ("infinitebench", "passkey.jsonl", {"context": "c", "answer": "12"}, "input", "is missing"),
])
def test_answers_the_metric_cannot_score_against_are_refused_when_read(tmp_path, benchmark, file, row, field, problem):
    """An answer its metric reads as a number or a paragraph id that is none would crash scoring after the model ran; an
    empty one matches every prediction: each stops the read, naming the file, the row and the field."""
    path = write_rows(tmp_path / file, [row])
    with pytest.raises(ValueError, match=rf"{file}: row 0: field '{field}' {problem}"):
        load_benchmark(benchmark, path)


def test_ruler_task_names_are_a_family_or_a_family_and_an_underscore(tmp_path):
    """Task names were matched by prefix: a RULER folder or kvpress task "qaz" or "vtx" got RULER's string matching."""
    for name in ("qaz", "vtx"):
        path = write_rows(tmp_path / f"{name}.jsonl", [{"input": "context\nquestion?", "outputs": ["1"], "length": 5}])
        with pytest.raises(ValueError, match=f"RULER task '{name}' is unknown"):
            load_benchmark("ruler", path)
        kvp = write_rows(tmp_path / f"kvp_{name}.jsonl", [{"context": "c", "question": "q", "answer": "1", "task": name, "max_new_tokens": 8}])
        with pytest.raises(ValueError, match=f"'{name}' is not a RULER, LongBench or InfiniteBench task name"):
            load_benchmark("kvpress", kvp)
    path = write_rows(tmp_path / "qa_2.jsonl", [{"input": "context\nquestion?", "outputs": ["1"], "length": 5}])
    assert load_benchmark("ruler", path)[0].metric == "string_match_part"


def test_kvpress_rows_of_longbench_keep_their_answers_field(tmp_path):
    """kvpress's LongBench data keeps LongBench's `answers` column (RULER's and InfiniteBench's keep `answer`): the loader
    refused it ("field 'answer' is missing")."""
    path = write_rows(tmp_path / "kvp.jsonl", [{"context": "c", "question": "q", "answers": ["Paris", "paris"], "task": "hotpotqa",
                                                "max_new_tokens": 8}])
    (item,) = load_benchmark("kvpress", path)
    assert item.answers == ("Paris", "paris") and item.metric == "qa_f1"


def test_a_directory_of_parquet_files_is_read_for_every_benchmark(tmp_path):
    import datasets

    rows = [json.loads(line) for line in (FIXTURES / "longbench/hotpotqa.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "hotpotqa.parquet"))
    (tmp_path / "dataset_info.json").write_text("{}")  # a stray JSON file beside the data is not read as rows
    assert [i.answers for i in load_benchmark("longbench", tmp_path)] == [i.answers for i in load_benchmark("longbench", FIXTURES / "longbench/hotpotqa.jsonl")]


def test_a_missing_optional_package_is_one_line_naming_its_install(tmp_path, capsys, monkeypatch):
    from kvcompress.checks import MissingPackage
    from kvcompress.eval.ray_sweep import run_sweep_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(MissingPackage, match=r"running a sweep as Ray tasks needs the `ray` package, which is not installed: pip install kvcompress\[ray\]"):
        run_sweep_ray(None, None, tmp_path)
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert main(["eval", "--benchmark", "ruler", "--data", str(FIXTURES / "ruler"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvcompress eval: error: reading benchmark files needs the `datasets` package, which is not installed: "
                   "pip install kvcompress[bench]")


@pytest.mark.parametrize("task, module, metric", [("multifieldqa_zh", "jieba", "qa_f1_zh"), ("gov_report", "rouge_score", "rouge_l"),
                                                  ("lcc", "rapidfuzz", "code_similarity")])
def test_a_metric_whose_package_is_missing_is_refused_before_the_model_runs(tmp_path, capsys, monkeypatch, task, module, metric):
    """The scorers import jieba, rouge-score and rapidfuzz when they score: without one, the sweep ran the model and then
    stopped with a traceback, losing the answers."""
    monkeypatch.setitem(sys.modules, module, None)
    row = {"context": "c", "input": "q", "answers": ["a b"], "length": 2, "dataset": task, "all_classes": None}
    data = write_rows(tmp_path / f"{task}.jsonl", [row])
    assert main(["eval", "--benchmark", "longbench", "--data", str(data), "--tasks", task, "--methods", "keydiff",
                 "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == (f"kvcompress eval: error: the metric {metric!r} needs the `{module}` package, which "
                                               "is not installed: pip install kvcompress[bench]")
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_cli_methods_full_runs_the_full_cache_cells_alone(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    args = ["eval", "--tasks", "niah_single", "--lengths", "128", "--samples", "2", "--model", str(tiny_checkpoint), "--methods", "full",
            "--max-new-tokens", "2", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    assert [(r["method"], r["index"]) for r in read_results(out / "results.jsonl")] == [(FULL, 0), (FULL, 1)]


def test_an_empty_answer_loads_where_its_metric_gives_it_no_marks(tmp_path):
    """QA F1 scores an empty gold answer 0 for any prediction: such a row loads (only the substring metrics refuse one)."""
    row = {"context": "c", "input": "q", "answers": ["", "Paris"], "length": 2, "dataset": "hotpotqa", "all_classes": None}
    (item,) = load_benchmark("longbench", write_rows(tmp_path / "hotpotqa.jsonl", [row]))
    assert item.score("Paris") == 1.0 and item.score("Rome") == 0.0


def _usage_error(capsys, run) -> str:
    """The one-line argparse error `run()` exits with (status 2), before any model loads."""
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_default_cost_refuses_unknown_variants_modes_and_ratios_before_the_model_loads(capsys, monkeypatch, tmp_path):
    """benchmarks/default_cost.py: --methods, --modes and --ratios are checked when parsed (naming the flag, what it got and
    what it takes), and a choice of variants and modes of which no cell runs is refused, all before any model loads."""
    default_cost = _script("default_cost.py")
    monkeypatch.setattr(default_cost.kvc, "load_model", lambda: pytest.fail("a model was loaded"))
    out = ["--out", str(tmp_path / "cost.csv")]
    error = _usage_error(capsys, lambda: default_cost.main(["--modes", "prefil", "--pairing", "cell", *out]))
    assert "--modes" in error and "'prefil'" in error and "prefill, chunked, decode" in error
    error = _usage_error(capsys, lambda: default_cost.main(["--methods", "default,bogus", *out]))
    assert "--methods" in error and "'bogus'" in error and "kvzip_refit" in error
    error = _usage_error(capsys, lambda: default_cost.main(["--ratios", "0.5,1.5", *out]))
    assert "--ratios" in error and "1.5" in error and "[0, 1)" in error
    error = _usage_error(capsys, lambda: default_cost.main(["--methods", "kvzip_refit", "--modes", "chunked,decode", *out]))
    assert "--methods kvzip_refit" in error and "'prefill' only" in error
    assert not (tmp_path / "cost.csv").exists()


def test_default_cost_leaves_a_variant_out_of_exactly_the_modes_it_does_not_run_in():
    """benchmarks/default_cost.py decides up front which (variant, mode) cells do not run (`mode_refusal`), as the library
    decides when it builds the options: a prefill-only named setting in a stream, a stream's slack or block size in prefill
    mode; every other cell is measured."""
    default_cost = _script("default_cost.py")
    from kvcompress.options import CompressionOptions

    for name, (method, params, exact) in default_cost.VARIANTS.items():
        for mode in ("prefill", "chunked", "decode"):
            try:
                CompressionOptions.build(method=method, method_params=params, compression_ratio=0.75, mode=mode, **exact)
                refused = None
            except ValueError as error:
                refused = str(error)
            assert (default_cost.mode_refusal(name, mode) is None) == (refused is None), (name, mode, refused)
    args = default_cost.parse_args(["--methods", "default,kvzip_refit,streams_full_precision", "--modes", "prefill,chunked",
                                    "--ratios", "0.5", "--out", "unused.csv"])
    assert default_cost.cells_of(args) == [("default", "prefill", 0.5), ("default", "chunked", 0.5), ("kvzip_refit", "prefill", 0.5),
                                           ("streams_full_precision", "chunked", 0.5)]


def test_side_by_side_scripts_refuse_a_ratio_outside_0_to_1_when_parsed(capsys):
    """benchmarks/kvpress_side_by_side.py's --ratios (dump and the model steps), and the scripts that read its folders,
    take compression ratios in [0, 1) only: 1.5 is refused naming the flag, before the samples or the model are read."""
    harness = _script("kvpress_side_by_side.py")
    assert harness.parse_ratios("0,0.5,0.9") == [0.0, 0.5, 0.9]
    for argv in (["kvcompress", "--cells", "knorm", "--ratios", "1.5"], ["dump", "--ratios", "0.5,-0.1"], ["kvpress", "--ratios", "x"]):
        error = _usage_error(capsys, lambda: harness.main(argv))
        assert "argument --ratios" in error and "[0, 1)" in error and repr(argv[-1]) in error
    answer_margin, needle_retention = _script("answer_margin.py"), _script("needle_retention.py")
    error = _usage_error(capsys, lambda: answer_margin.main(["--out", "x", "--cells", "knorm", "--ratios", "1.5"]))
    assert "argument --ratios" in error and "'1.5'" in error
    error = _usage_error(capsys, lambda: needle_retention.main(["--out", "x", "--cell", "knorm", "--ratios", "1", "--sample-indices", "0"]))
    assert "argument --ratios" in error and "'1'" in error


def test_needle_retention_offers_and_takes_the_compressing_prefill_cells_only(capsys):
    """benchmarks/needle_retention.py's --cell: its help lists the cells it takes, and a streaming cell (or the full cache)
    is refused naming the flag."""
    needle_retention = _script("needle_retention.py")
    harness = sys.modules["kvpress_side_by_side"]
    streaming = sorted(label for label in harness.KVCOMPRESS_CELLS if harness.streams(label))
    assert streaming
    with pytest.raises(SystemExit):
        needle_retention.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "adakv[scorer=kvzip,scope=model,window=0,alpha=0.05]" in help_text
    assert not [label for label in streaming + [harness.FULL] if repr(label) in help_text]
    for cell in (streaming[0], harness.FULL):
        error = _usage_error(capsys, lambda: needle_retention.main(["--out", "x", "--cell", cell, "--ratios", "0.5", "--sample-indices", "0"]))
        assert "error: --cell must be a compressing prefill cell" in error and repr(cell) in error


def test_native_speed_refuses_contexts_too_short_for_the_kept_fraction_and_two_runs_at_once(capsys, monkeypatch):
    """benchmarks/native_speed.py: a context that leaves the kept fraction no room beyond the exact sink and window, a fraction
    kept outside (0, 1], and two of its runs at once are usage errors naming the flags, before any model loads."""
    native_speed = _script("native_speed.py")
    monkeypatch.setattr(native_speed, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    error = _usage_error(capsys, lambda: native_speed.main(["--contexts", "1024", "256"]))
    assert "--contexts 256 with --kept 0.1" in error and "compression_ratio <=" in error
    error = _usage_error(capsys, lambda: native_speed.main(["--llama8b", "--contexts", "512", "--kept-fractions", "0.5", "0.1"]))
    assert "--contexts 512 with --kept-fractions 0.1" in error
    assert "--kept takes fractions" in _usage_error(capsys, lambda: native_speed.main(["--kept", "1.5"]))
    error = _usage_error(capsys, lambda: native_speed.main(["--synthetic-cache", "--weighted-paths"]))
    assert error.endswith("got --weighted-paths, --synthetic-cache")


def test_refit_cost_checks_its_ratios_and_writes_where_out_says(capsys):
    """benchmarks/refit_cost.py: --ratios outside [0, 1) are refused naming the flag; --out defaults to the committed CSV of the
    refit timed."""
    refit_cost = _script("refit_cost.py")
    error = _usage_error(capsys, lambda: refit_cost.parse_args(["--ratios", "0.5", "1.5"]))
    assert "argument --ratios: expected compression ratios in [0, 1)" in error and "1.5" in error
    assert refit_cost.parse_args([]).out == REPO / "benchmarks" / "results" / "refit_cost_log_weights_values.csv"
    assert refit_cost.parse_args(["--refit", "log_weights", "--out", "x/r.csv"]).out == Path("x/r.csv")
    error = _usage_error(capsys, lambda: refit_cost.parse_args(["--out", "x/r.md"]))  # the page beside it would replace it
    assert "argument --out: expected the path of a .csv file" in error


@pytest.mark.parametrize("script, argv, flag, got", [
    ("tuning/equal_memory.py", ["--out", "x.jsonl", "--modes", "prefill,prefil"], "--modes", "prefil"),
    ("tuning/kvzap_default.py", ["--out", "x.jsonl", "--modes", "decod"], "--modes", "decod"),
    ("tuning/kvzap_default.py", ["--out", "x.jsonl", "--variants", "full,bogus"], "--variants", "bogus"),
])
def test_tuning_scripts_refuse_unknown_modes_and_variants_before_the_model_loads(capsys, monkeypatch, script, argv, flag, got):
    module = _script(script)
    monkeypatch.setattr(module.kvc, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    error = _usage_error(capsys, module.main)
    assert f"argument {flag}" in error and repr(got) in error


def test_scripts_that_write_committed_results_say_where_and_take_out(capsys, monkeypatch):
    """tova_kvpress_check.py answers --help without running (and takes --out); many_questions.py takes --out, by default the
    committed CSV; quantized_storage.py's help names its real default folder."""
    for script, default in (("tova_kvpress_check.py", "benchmarks/results"), ("many_questions.py", "benchmarks/results/many_questions.csv"),
                            ("quantized_storage.py", "benchmarks/results/quantized_storage")):
        module = _script(script)
        monkeypatch.setattr(module.kvc, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
        monkeypatch.setattr(sys, "argv", [script, "--help"])
        with pytest.raises(SystemExit) as exited:
            module.main() if script != "quantized_storage.py" else module.parse_args()
        assert exited.value.code == 0
        help_text = " ".join(capsys.readouterr().out.split())
        assert "--out" in help_text and f"(default {default}" in help_text.replace("(default: ", "(default "), script
        if script == "tova_kvpress_check.py":  # its description is the module's docstring
            assert " ".join(module.__doc__.split()) in help_text


def test_report_quotes_the_held_out_sets_full_cache_hits_from_the_records(monkeypatch):
    """benchmarks/report.py: the sixth held-out set's introduction gives the range of the full cache's hits over the first
    five sets and the sixth's own hits out of its needles, as `full_cache_hits` reads them."""
    report = _script("report.py")
    hits = {("heldout", 2048): 19, ("heldout", 4096): 16, ("heldout2", 2048): 12, ("heldout2", 4096): 7, ("heldout3", 2048): 14,
            ("heldout3", 4096): 9, ("heldout4", 2048): 20, ("heldout4", 4096): 14, ("heldout5", 2048): 19, ("heldout5", 4096): 16}
    assert {key: report.full_cache_hits(*key)[0] for key in hits} == hits
    assert [report.full_cache_hits("heldout6", length) for length in (2048, 4096)] == [(64, 100), (48, 100)]
    intro = report.heldout6_section()[2]
    assert "(7–20 per length)" in intro and "found 64 of 100 at 2048 and 48 of 100 at 4096 tokens" in intro
    monkeypatch.setattr(report, "full_cache_hits", lambda name, length: (3, 50) if name == "heldout6" else (length // 1000, 30))
    intro = report.heldout6_section()[2]
    assert "(2–4 per length)" in intro and "found 3 of 50 at 2048 and 3 of 50 at 4096 tokens" in intro


def test_report_equal_memory_notes_count_from_the_records(monkeypatch):
    """benchmarks/report.py: the equal-memory tables' notes count won and lost needles (groups of 16 against 32, 8 bits
    against 4), the full cache's hits and 2 bits' needles from the records they describe."""
    report = _script("report.py")
    note = report.equal_memory_note("_exact_sink_4k", "4k", "")
    assert ("against groups of 32, needle by needle, 1 won and 2 lost at 0.75's bytes, 1 won and 0 lost at 0.9's" in note
            and "on the full cache's 17 hits only" in note and "stopped after 11 needles" in note)
    assert ("at 0.75 (`q4_0`, every token) 1 won and 0 lost at 2k, 4 won and 1 lost at 4k; at 0.9 (`q4m_0.9`) 3 won and 6 lost "
            "at 2k, 2 won and 1 lost at 4k" in note)
    hit, miss = {"1000": 1.0, "1001": 1.0, "1002": 0.0}, {"1000": 0.0, "1001": 0.0, "1002": 1.0}
    monkeypatch.setattr(report, "equal_memory_hits", lambda suffix, variant, mode="prefill": hit if variant.startswith(("q8", "q4g16", "full", "q2")) else miss)
    note = report.equal_memory_note("_exact_sink_4k", "4k", "")
    assert "2 won and 1 lost at 0.75's bytes" in note and "full cache's 2 hits only" in note and "stopped after 3 needles" in note
    assert report.equal_memory_note("", "2k", "") == report.equal_memory_note("_4k", "2k", "")  # no counts without the sink exact


def test_report_gives_the_methods_that_name_a_cost_records_rows(monkeypatch):
    """benchmarks/report.py: a `default_cost.py` record whose rows name variants its recorded `--methods` do not, or whose
    command names a name that is not a variant of the script, gets the `--methods` that names its rows' variants and
    the names that are none; a matching one gets no such line."""
    report = _script("report.py")
    command = ".venv/bin/python benchmarks/default_cost.py --lengths 2048 --methods {} --modes chunked --out x.csv"
    rows = [{"method": "plain"}, {"method": "streams_full_precision"}, {"method": "default"}]
    entries = {"a.csv": {"command": [command.format("default")]}, "b.csv": {"command": [command.format("default,streams_full_precision")]},
               "c.csv": {"command": [command.format("default,default_chunk_128")]}, "d.csv": {"command": ["kvcompress bench --out d"]}}
    monkeypatch.setattr(report, "run_entry", entries.__getitem__)
    (line, _) = report.cost_command_mismatch("a.csv", rows)
    assert line == "These rows' variants are `--methods default,streams_full_precision` of `benchmarks/default_cost.py`."
    assert report.cost_command_mismatch("b.csv", rows) == [] and report.cost_command_mismatch("d.csv", rows) == []
    (line, _) = report.cost_command_mismatch("c.csv", rows)
    assert "`default_chunk_128` is not a variant of it" in line
