"""Offline task generators: answers really sit in the context at the stated depth; scorers."""

import re
import signal

import pytest

from kvcompress.eval import tasks as T


@pytest.mark.parametrize("haystack", T.HAYSTACKS)
@pytest.mark.parametrize("kind", T.NEEDLE_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_single_needle_at_stated_depth(haystack, kind, depth):
    s = T.niah_single(1000, depth, seed=5, haystack=haystack, kind=kind)
    (answer,) = s.answers
    (needle,) = s.needles
    assert s.context.count(needle) == 1 and answer in needle
    start = s.context.index(needle)
    assert abs(start / len(s.context) - depth) < 0.05
    assert abs(s.depth - depth) < 0.05
    assert abs(s.n_tokens - 1000) < 60
    assert T.score(s, f"The value is {answer}.") == 1.0


def test_same_seed_same_sample_and_different_seeds_differ():
    a, b, c = (T.niah_single(800, 0.5, seed=k) for k in (1, 1, 2))
    assert a == b
    assert a.answers != c.answers


@pytest.mark.parametrize("task", ["niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_multi_needles_present_and_answers_are_asked(task):
    count = {"niah_multikey": "n_keys", "niah_multivalue": "n_values", "niah_multiquery": "n_queries"}[task]
    s = T.generate_sample(task, target_tokens=1500, depth=0.6, seed=3, **{count: 4})
    assert len(s.needles) == 4 and len(s.depths) == 4
    for needle, depth in zip(s.needles, s.depths):
        assert s.context.count(needle) == 1
        assert abs(s.context.index(needle) / len(s.context) - depth) < 0.05
    assert abs(s.depth - 0.6) < 0.05
    for a in s.answers:
        assert a in s.context
    asked = re.findall(r"for (.*) mentioned", s.question)[0].split(", ")
    if task == "niah_multikey":
        assert len(asked) == 1 and len(s.answers) == 1
        distractor_values = [n.rsplit(" ", 1)[1].rstrip(".") for n in s.needles[1:]]
        assert T.score(s, distractor_values[0]) == 0.0
    elif task == "niah_multivalue":
        assert len(asked) == 1 and len(s.answers) == 4
        assert T.score(s, " ".join(s.answers[:2])) == 0.5
    else:
        assert len(asked) == 4 and len(s.answers) == 4
    assert T.score(s, ", ".join(s.answers)) == 1.0


def test_variable_tracking_chain_resolves_to_answer():
    s = T.variable_tracking(1500, depth=0.2, seed=4, n_hops=3, n_chains=2)
    value = re.search(r"value (\d+)", s.question).group(1)
    assign = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", s.context))
    holding = {v for v in assign if _resolve(assign, v) == value}
    assert holding == set(s.answers) and len(s.answers) == 4
    first = s.context.index(f"VAR {s.answers[0]} = {value}.")
    assert abs(first / len(s.context) - 0.2) < 0.05
    assert T.score(s, " ".join(s.answers)) == 1.0
    other = next(v for v in assign if v not in holding)
    assert T.score(s, other) == 0.0


def _resolve(assign, name):
    while assign[name].startswith("VAR "):
        name = assign[name][4:]
    return assign[name]


def test_common_words_refuse_a_length_shorter_than_the_common_words_alone():
    with pytest.raises(ValueError, match=r"target_tokens=512 is shorter than the common words alone: n_common=10 words × common_freq=30"):
        T.common_words(512)
    assert T.common_words(512, n_common=5, common_freq=8).n_tokens <= 600


def test_common_words_are_most_common():
    s = T.common_words(1500, seed=2, n_common=5, common_freq=20, rare_freq=2)
    words = re.findall(r"\d+\. (\w+)", s.context)
    counts = {w: words.count(w) for w in set(words)}
    assert all(counts[w] == 20 for w in s.answers)
    assert max(c for w, c in counts.items() if w not in s.answers) == 2
    assert T.score(s, ", ".join(s.answers)) == 1.0
    assert T.score(s, ", ".join(s.answers[:2])) == pytest.approx(0.4)


def test_frequent_words_are_strictly_most_frequent():
    s = T.frequent_words(1500, seed=2, n_answers=3)
    words = s.context.split()
    counts = sorted(((words.count(w), w) for w in set(words)), reverse=True)
    assert [w for _, w in counts[:3]] == s.answers
    assert counts[2][0] > counts[3][0]
    assert abs(s.n_tokens - 1500) < 150


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_line_retrieval_target_line(depth):
    s = T.line_retrieval(1200, depth, seed=1)
    topic = re.search(r"line (\S+)\?", s.question).group(1)
    lines = s.context.split("\n")
    idx = [i for i, line in enumerate(lines) if line.startswith(f"line {topic}:")]
    assert len(idx) == 1
    assert lines[idx[0]] == s.needles[0] and f"<{s.answers[0]}>" in lines[idx[0]]
    assert abs(idx[0] / max(1, len(lines) - 1) - depth) < 0.02
    assert T.score(s, f"The REGISTER_CONTENT in line {topic} is <{s.answers[0]}>.") == 1.0
    assert T.score(s, "It is 99999999.") == 0.0
    assert T.score(s, "I do not know.") == 0.0


@pytest.mark.parametrize("n_lines", [1, 3])
def test_line_retrieval_sparse_lines_in_prose(n_lines):
    s = T.line_retrieval(1500, 0.3, seed=2, n_lines=n_lines, haystack="prose")
    topic = re.search(r"line (\S+)\?", s.question).group(1)
    assert len(re.findall(r"line \S+: REGISTER_CONTENT is <\d+>", s.context)) == n_lines
    assert s.context.count(s.needles[0]) == 1 and f"<{s.answers[0]}>" in s.needles[0]
    before = s.context[: s.context.index(s.needles[0])]
    assert abs(len(before) / len(s.context) - 0.3) < 0.05 and abs(s.depth - 0.3) < 0.05
    assert s.answer_prefix == f"line {topic}: REGISTER_CONTENT is <"
    assert T.score(s, f"{s.answers[0]}>") == 1.0
    with pytest.raises(ValueError, match="n_lines"):
        T.line_retrieval(500, n_lines=0)


def test_scorer_needs_whole_answer():
    s = T.niah_single(600, 0.5, seed=0)
    a = s.answers[0]
    assert T.score(s, a[:-1]) == 0.0
    assert T.score(s, a + "9") == 0.0
    assert T.score(s, f"**{a}**") == 1.0


def test_token_length_calibrated_with_tokenizer_counter():
    def split_words(texts, add_special_tokens):
        return {"input_ids": [t.split() for t in texts]}

    s = T.niah_single(700, 0.5, seed=0, tokenizer=None)
    w = T.niah_single(700, 0.5, seed=0, tokenizer=split_words)
    assert abs(w.n_tokens - 700) < 15 and w.n_tokens == len(w.context.split())
    assert len(w.context) > len(s.context)


def test_bad_parameters():
    with pytest.raises(ValueError, match="depth"):
        T.niah_single(500, 1.5)
    with pytest.raises(ValueError, match="haystack"):
        T.niah_single(500, 0.5, haystack="essays")
    with pytest.raises(ValueError, match="kind"):
        T.niah_single(500, 0.5, kind="colors")
    with pytest.raises(ValueError, match="target_tokens"):
        T.line_retrieval(10)
    with pytest.raises(ValueError, match="task"):
        T.generate_sample("needle")
    with pytest.raises(ValueError, match="n_keys"):
        T.niah_multikey(500, n_keys=1)


def test_task_parameters_name_what_each_generator_takes():
    assert {"depth", "haystack", "kind"} <= T.task_parameters("niah_single")
    assert "depth" not in T.task_parameters("common_words")
    assert {"split", "answer_kind"} <= T.task_parameters("niah_prose") and "haystack" not in T.task_parameters("niah_prose")
    with pytest.raises(ValueError, match="task must be one of .* got 'nope'"):
        T.task_parameters("nope")


@pytest.mark.e2e
@pytest.mark.smoke
@pytest.mark.parametrize("task", ["frequent_words", "common_words"])
def test_word_list_tasks_keep_to_their_length_with_the_default_tokenizer(default_model, task):
    """frequent_words estimated a word's tokens as a plain mean over 50 words while Zipf's law draws the top one most
    (8,513 tokens asked 8,000: past the model's 8,192 positions); common_words measured its labels at 100-149 where
    they run into the thousands (+87 to +273). Both now measure what they build."""
    _, tokenizer = default_model
    for target in (2048, 8000):
        for seed in range(3):
            sample = T.generate_sample(task, target_tokens=target, seed=seed, tokenizer=tokenizer)
            n = len(tokenizer(sample.context, add_special_tokens=False)["input_ids"])
            assert target - 64 <= n <= target + 24, (target, seed, n)


def test_needle_values_are_distinct_from_each_other_and_the_keys():
    """With kind='words', a value could be drawn twice (4 of 400 niah_multivalue samples with 4 values) or equal a key,
    so that one answer stood for two needles."""
    for seed in range(400):
        s = T.niah_multivalue(256, seed=seed, kind="words", n_values=4)
        assert len(set(s.answers)) == 4 and not set(s.answers) & set(re.findall(r"for (\w+) is", " ".join(s.needles)))


@pytest.mark.parametrize("task, kwargs, message", [
    ("niah_multikey", {"n_keys": 2.5}, r"n_keys must be an integer >= 2, got 2\.5"),
    ("frequent_words", {"vocab_size": None}, r"vocab_size must be an integer in \[4, \d+\] .*got None"),
    ("frequent_words", {"alpha": float("nan")}, r"alpha must be a finite number >= 1\.0, got nan"),
    ("common_words", {"n_common": True}, r"n_common must be an integer >= 1, got True"),
    ("common_words", {"common_freq": 3, "rare_freq": 3}, r"common_freq must be an integer >= 4 \(more than rare_freq=3\), got 3"),
    ("niah_single", {"seed": -1}, r"seed must be an integer >= 0, got -1"),
    ("niah_single", {"seed": 1.5}, r"seed must be an integer >= 0, got 1\.5"),
    ("niah_single", {"seed": "abc"}, r"seed must be an integer >= 0, got 'abc'"),
    ("niah_single", {"seed": None}, r"seed must be an integer >= 0, got None"),
    ("niah_single", {"depth": float("nan")}, r"depth must be a finite number in \[0\.0, 1\.0\], got nan"),
    ("niah_single", {"target_tokens": 300.5}, r"target_tokens must be an integer >= 64, got 300\.5"),
    ("niah_single", {"tokenizer": "gpt2"}, r"tokenizer must be None .* or a tokenizer .*got 'gpt2'"),
    ("niah_prose", {"answer_kind": 3}, r"answer_kind must be one of \('names', 'places', 'mixed'\), got 3"),
    ("line_retrieval", {"n_lines": 1.0}, r"n_lines must be an integer in \[1, \d+\] \(or None; .*got 1\.0"),
])
def test_generator_arguments_of_the_wrong_type_or_range_are_refused_by_name(task, kwargs, message):
    """2.5 keys, vocab_size None and a string tokenizer raised TypeErrors; alpha nan 'cannot convert float NaN to integer';
    True was taken as 1, seed -1 as seed 1 (random.Random takes its absolute value), seed None drew an unreproducible
    sample, depth nan and 300.5 tokens were used as given."""
    with pytest.raises(ValueError, match=message):
        T.generate_sample(task, **kwargs)
    with pytest.raises(ValueError, match=message.replace(list(kwargs)[0], "TASK." + list(kwargs)[0], 1)):
        T.check_task_params(task, kwargs, named=lambda name: f"TASK.{name}")


def _within(seconds, f):
    """f(), or a TimeoutError after `seconds` (a generator that loops for ever fails its test instead of hanging it)."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return f()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_more_than_a_generator_can_draw_is_refused_with_the_largest_that_works():
    """n_keys=1000000 gave 'Sample larger than population or is negative'; 20,000 chains of variables redrew their names
    for ever; words as values ran out of distinct words and drew for ever."""
    n_words = len(T.vocabulary())
    with pytest.raises(ValueError, match=rf"n_keys must be at most {n_words} with numbers as the values, got 1000000"):
        _within(30, lambda: T.niah_multikey(n_keys=1_000_000))
    with pytest.raises(ValueError, match=rf"n_keys must be at most {n_words // 2} with words as the values, got {n_words // 2 + 1}"):
        _within(30, lambda: T.niah_multikey(n_keys=n_words // 2 + 1, kind="words"))
    with pytest.raises(ValueError, match=r"n_values must be at most 9000000 with numbers as the values"):
        _within(30, lambda: T.niah_multivalue(n_values=10**7))
    with pytest.raises(ValueError, match=r"n_chains × \(n_hops \+ 1\), the variables named, must be at most 10000 .* got 20000 × "
                                         r"\(4 \+ 1\) = 100000: at most 2000 chains of 4 hops"):
        _within(30, lambda: T.variable_tracking(10**7, n_chains=20_000))


def test_inserted_items_longer_than_the_context_are_refused_with_how_many_fit():
    """100,000 lines in 2,048 tokens ran for hours (each line's depth searched a context of millions of characters) to
    make a context far longer than asked; 300 needles made one of twice the length asked."""
    with pytest.raises(ValueError, match=r"target_tokens=2048 is shorter than the 100000 items inserted alone \(about \d+ tokens; "
                                         r"about \d+ fit\): lower n_lines=100000 or ask for a longer context"):
        _within(60, lambda: T.line_retrieval(2048, n_lines=100_000))
    with pytest.raises(ValueError, match=r"shorter than the 300 items .* lower n_queries=300"):
        T.niah_multiquery(2048, n_queries=300)
    with pytest.raises(ValueError, match=r"lower n_chains=200 or n_hops=4"):
        T.variable_tracking(2048, n_chains=200)
    fits = T.niah_multiquery(2048, n_queries=100)
    assert fits.n_tokens <= 2048 + 8 and len(fits.needles) == 100


def test_scorers_refuse_no_answers_and_a_prediction_that_is_no_string():
    """An empty answer list divided by zero; a None prediction raised AttributeError."""
    from kvcompress.eval.metrics import string_match_all

    with pytest.raises(ValueError, match=r"answers must be a non-empty list of the expected answers, got \[\]"):
        T.whole_words_found([], "anything")
    with pytest.raises(ValueError, match=r"string_match_all: answers must be a non-empty list of the expected answers, got \[\]"):
        string_match_all("anything", [])
    for task in ("niah_single", "line_retrieval"):
        with pytest.raises(ValueError, match=r"prediction must be a string \(the model's answer; '' for none\), got None"):
            T.score(T.generate_sample(task, target_tokens=200), None)
    assert T.whole_words_found(["a", "b"], "A, c") == 0.5 and string_match_all("xay", ["A", "b"]) == 0.5
