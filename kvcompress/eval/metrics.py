"""The published benchmarks' own metrics: RULER, LongBench(-E) and InfiniteBench.

Each metric takes (prediction, answers, **extra) and returns a score in [0, 1]; `METRICS` maps a
metric name to it. The definitions restate the benchmarks' scoring scripts (RULER
`scripts/eval/synthetic/constants.py`, LongBench `metrics.py` / `eval.py`, InfiniteBench
`src/compute_scores.py`); tokenising and fuzzy matching use `jieba`, `rouge-score` and `rapidfuzz`.

Where a library replaces the one the benchmark used, the result can differ slightly:
- ROUGE-L: LongBench used the `rouge` package; here `rouge-score`'s ROUGE-L F-measure, on
  whitespace tokens of the lower-cased text with punctuation removed (Chinese: jieba words), so a
  Chinese summary is not emptied by rouge-score's ASCII-only default tokenizer.
- Code similarity: LongBench used fuzzywuzzy's `ratio`; rapidfuzz's `fuzz.ratio` is the same
  Indel similarity.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_PUNCTUATION = set(string.punctuation)
_ALL_PUNCTUATION = _EN_PUNCTUATION | set(_ZH_PUNCTUATION)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no ASCII punctuation, no articles (a/an/the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lower case, no ASCII or Chinese punctuation, no whitespace at all."""
    return "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION and not ch.isspace())


def token_f1(prediction: Sequence[str], truth: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(truth)
    return 2 * precision * recall / (precision + recall)


def _jieba_words(text: str) -> list[str]:
    import jieba

    jieba.setLogLevel(60)
    return list(jieba.cut(text, cut_all=False))


def _best(metric: Callable[[str, str], float]) -> Callable[..., float]:
    """A per-answer metric -> the best score over every accepted answer (the benchmarks' rule)."""

    def scored(prediction: str, answers: Sequence[str], **extra) -> float:
        return max(metric(prediction, a, **extra) for a in answers)

    scored.__name__ = metric.__name__
    scored.__doc__ = metric.__doc__
    return scored


def qa_f1(prediction: str, answer: str, **_) -> float:
    """LongBench / InfiniteBench English QA F1 on normalised whitespace tokens."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(answer).split())


def qa_f1_zh(prediction: str, answer: str, **_) -> float:
    """LongBench Chinese QA F1: jieba words, each normalised, empty ones dropped."""
    def words(text):
        return [w for w in map(normalize_zh_answer, _jieba_words(text)) if w]

    return token_f1(words(prediction), words(answer))


def qa_f1_zh_chars(prediction: str, answer: str, **_) -> float:
    """InfiniteBench Chinese QA F1: one token per character of the normalised text."""
    return token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(answer)))


class _WhitespaceTokenizer:
    """rouge-score tokenizer: whitespace tokens of the lower-cased text, punctuation removed."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return "".join(" " if ch in _ALL_PUNCTUATION else ch for ch in text.lower()).split()


def _rouge(prediction_words: str, answer_words: str, kind: str = "rougeL") -> float:
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer([kind], tokenizer=_WhitespaceTokenizer())
    return scorer.score(answer_words, prediction_words)[kind].fmeasure


def rouge_l(prediction: str, answer: str, **_) -> float:
    """LongBench ROUGE-L F-measure (English)."""
    return _rouge(prediction, answer)


def rouge_l_zh(prediction: str, answer: str, **_) -> float:
    """LongBench ROUGE-L F-measure on jieba words (Chinese)."""
    return _rouge(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(answer)))


def rouge_lsum(prediction: str, answer: str, **_) -> float:
    """InfiniteBench summary score: ROUGE-Lsum F-measure (sentences split at line breaks)."""
    return _rouge(prediction, answer, "rougeLsum")


def classification(prediction: str, answer: str, all_classes: Sequence[str] = (), **_) -> float:
    """LongBench classification: 1/m when the true class is among the m classes named in the prediction.

    A named class that is a proper substring of the true class does not count (naming
    "location" inside "other location" is not a second guess).
    """
    if not all_classes:
        raise ValueError("classification needs all_classes (the benchmark's list of class names), got none")
    named = [c for c in all_classes if c in prediction and not (c in answer and c != answer)]
    return 1.0 / len(named) if answer in named else 0.0


def _number_share(prediction: str, wanted: str) -> float:
    """Fraction of the integers in the prediction that equal `wanted` (0 with no integer)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == wanted for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, answer: str, **_) -> float:
    """LongBench passage retrieval (en): share of the prediction's numbers that name the right 'Paragraph N'."""
    return _number_share(prediction, _paragraph_id(answer, _PARAGRAPH))


def retrieval_zh(prediction: str, answer: str, **_) -> float:
    """LongBench passage retrieval (zh): as `retrieval`, for answers '段落N'."""
    return _number_share(prediction, _paragraph_id(answer, _PARAGRAPH_ZH))


_PARAGRAPH, _PARAGRAPH_ZH = r"Paragraph (\d+)", r"段落(\d+)"  # how a retrieval answer names its paragraph


def _paragraph_id(answer: str, pattern: str) -> str:
    found = re.search(pattern, answer)
    if found is None:
        raise ValueError(f"must name its paragraph as {pattern!r} does, got {answer!r}")
    return found.group(1)


def count(prediction: str, answer: str, **_) -> float:
    """LongBench passage count: share of the prediction's numbers equal to the answer."""
    return _number_share(prediction, str(answer))


def code_similarity(prediction: str, answer: str, **_) -> float:
    """LongBench code completion: fuzzy ratio of the first code line of the prediction and the answer.

    The first line (after leading blank lines) holding no backtick, '#' or '//' is compared;
    none such compares the empty string.
    """
    from rapidfuzz import fuzz

    lines = prediction.lstrip("\n").split("\n")
    line = next((ln for ln in lines if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return fuzz.ratio(line, answer) / 100.0


def string_match_all(prediction: str, answers: Sequence[str], **_) -> float:
    """RULER: fraction of the answers contained in the prediction (case-insensitive substrings); no answers is a ValueError."""
    if isinstance(answers, str) or not answers:
        raise ValueError(f"string_match_all: answers must be a non-empty list of the expected answers, got {answers!r}")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], **_) -> float:
    """RULER QA: 1 when any answer is contained in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return float(any(a.lower() in pred for a in answers))


def first_integer(prediction: str) -> str:
    """The first run of digits in the prediction, or ''."""
    found = re.search(r"\d+", prediction)
    return found.group(0) if found else ""


def first_integer_match(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench passkey / number_string: the first integer equals the answer."""
    return float(first_integer(prediction) == str(answers[0]))


def word_match(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench kv_retrieval: the answer is one of the prediction's words (split at spaces and ':".,?!{}')."""
    words = re.sub(r"[\n:\"'.,?!{}]", " ", prediction).split()
    return float(str(answers[0]) in words)


def contains_upper(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench longdialogue_qa_eng: any answer occurs in the prediction, case-insensitive."""
    pred = prediction.upper()
    return float(any(a.upper() in pred for a in answers))


def first_number_match(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench math_find: the first number (integer or decimal) equals the answer's value."""
    found = re.search(r"\d+\.\d+|\d+", prediction)
    return float(found is not None and float(found.group(0)) == float(answers[0]))


_INTEGER = re.compile(r"[+-]?[0-9]+")


def last_word_integer(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench code_run: the prediction's last word (split at spaces and .`'\":) is the answer's integer (a word
    that is no integer, such as '--5' or '5²', scores 0, as InfiniteBench's failed int() does)."""
    words = re.sub(r"[\n.`'\":]", " ", prediction.strip()).split()
    return float(bool(words) and _INTEGER.fullmatch(words[-1]) is not None and int(words[-1]) == int(answers[0]))


def number_prefix(prediction: str, answers: Sequence[str], **_) -> float:
    """InfiniteBench math_calc: fraction of the expected numbers matched in order before the first mismatch."""
    predicted = re.findall(r"\d+", prediction)
    expected = [str(int(a)) for a in answers]
    matched = 0
    for want, got in zip(expected, predicted):
        if want != str(int(got)):
            break
        matched += 1
    return matched / len(expected)


OPTION_LETTERS = "ABCDEFGHIJ"  # the letters multiple-choice options are listed and chosen by


def option_choice(prediction: str, answers: Sequence[str], options: Sequence[str] = (), **_) -> float:
    """InfiniteBench multiple choice (longbook_choice_eng, code_debug): the chosen option is right.

    The choice is read in InfiniteBench's order: the option letter the prediction starts with (a letter followed by
    no other letter, so "A" but not "Alice"); else what follows its first "answer is", "answer:" or "option is" (any
    case), which is right when it starts with the right option's letter or text and wrong otherwise; else its first
    standalone option letter; else whether it starts with the right option's text. answers[0] is the right option's
    text, which must be one of `options`.
    """
    if answers[0] not in options:
        raise ValueError(f"option_choice: the answer {answers[0]!r} must be one of the options {list(options)}")
    if len(options) > len(OPTION_LETTERS):
        raise ValueError(f"option_choice: at most {len(OPTION_LETTERS)} options, got {len(options)}")
    letters = OPTION_LETTERS[: len(options)]
    right = letters[list(options).index(answers[0])]
    pred = prediction.strip()
    first = re.match(rf"[{letters}](?![A-Za-z])", pred)
    if first:
        return float(first.group() == right)
    phrase = _ANSWER_PHRASE.search(pred)
    if phrase:
        after = pred[phrase.end() :].lstrip(_AFTER_PHRASE)
        return float(re.match(rf"{right}(?![A-Za-z])", after) is not None or after.startswith(answers[0]))
    chosen = re.search(rf"\b[{letters}]\b", pred)
    if chosen:
        return float(chosen.group() == right)
    return float(pred.startswith(answers[0]))


_ANSWER_PHRASE = re.compile(r"answer is:?|answer:|option is:?", re.IGNORECASE)  # `option_choice`'s answer phrases
_AFTER_PHRASE = " \t\n\"'`*(["  # what may stand between such a phrase and the choice


def _integers(answers: Sequence[str]) -> None:
    for a in answers:
        if _INTEGER.fullmatch(a.strip()) is None:
            raise ValueError(f"must be an integer, got {a!r}")


def _number(answers: Sequence[str]) -> None:
    try:
        float(answers[0])
    except ValueError:
        raise ValueError(f"must be a number, got {answers[0]!r}") from None


def _paragraphs(pattern: str) -> Callable[[Sequence[str]], None]:
    def check(answers: Sequence[str]) -> None:
        for a in answers:
            _paragraph_id(a, pattern)

    return check


# metric -> a check that raises ValueError(what is wrong) for answers the metric cannot score against
_ANSWER_CHECKS: dict[str, Callable[[Sequence[str]], None]] = {
    "retrieval": _paragraphs(_PARAGRAPH),
    "retrieval_zh": _paragraphs(_PARAGRAPH_ZH),
    "first_number_match": _number,
    "first_integer_match": lambda answers: _integers(answers[:1]),  # compared with the prediction's first integer as text
    "count": _integers,  # compared with the prediction's numbers as text
    "last_word_integer": lambda answers: _integers(answers[:1]),
    "number_prefix": _integers,
}


# metrics an empty answer gives every prediction full marks under (a substring of anything; a number-free prediction's '')
_EMPTY_MATCHES_ALL = {"string_match_all", "string_match_part", "contains_upper", "first_integer_match"}


# the optional packages (of kvcompress[bench]) each metric scores with
METRIC_PACKAGES = {"qa_f1_zh": ("jieba",), "rouge_l": ("rouge_score",), "rouge_l_zh": ("jieba", "rouge_score"),
                   "rouge_lsum": ("rouge_score",), "code_similarity": ("rapidfuzz",)}


def require_metric_packages(metric: str) -> None:
    """`checks.MissingPackage` naming the metric and `pip install kvcompress[bench]` when a package `metric` scores with
    is not installed: checked when the data is read, before the model answers."""
    from ..checks import require_package  # here: the command line's parser imports this module, and checks imports torch

    for module in METRIC_PACKAGES.get(metric, ()):
        require_package(module, "bench", f"the metric {metric!r}")


def answer_problem(metric: str, answers: Sequence[str]) -> str | None:
    """What is wrong with `answers` for `metric` (an empty answer where the metric would give any prediction full marks
    for it; an answer the metric reads as a number or a paragraph id that is none), or None: checked when the data is
    read, so that scoring a prediction never fails."""
    if metric in _EMPTY_MATCHES_ALL and any(not a.strip() for a in answers):
        return f"must not hold an empty answer (every prediction would match it), got {list(answers)!r}"
    try:
        _ANSWER_CHECKS.get(metric, lambda _: None)(answers)
    except ValueError as err:
        return f"{err} (metric {metric})"
    return None


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": _best(qa_f1),
    "qa_f1_zh": _best(qa_f1_zh),
    "qa_f1_zh_chars": _best(qa_f1_zh_chars),
    "rouge_l": _best(rouge_l),
    "rouge_l_zh": _best(rouge_l_zh),
    "rouge_lsum": _best(rouge_lsum),
    "classification": _best(classification),
    "retrieval": _best(retrieval),
    "retrieval_zh": _best(retrieval_zh),
    "count": _best(count),
    "code_similarity": _best(code_similarity),
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "first_integer_match": first_integer_match,
    "word_match": word_match,
    "contains_upper": contains_upper,
    "first_number_match": first_number_match,
    "last_word_integer": last_word_integer,
    "number_prefix": number_prefix,
    "option_choice": option_choice,
}
