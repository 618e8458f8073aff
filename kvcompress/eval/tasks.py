"""Offline long-context tasks: RULER-style synthetic tasks, LongEval line retrieval, needle grids.

Every generator is seeded (`random.Random(seed)`) and returns a `Sample`: the context, the
question (asked after the context, see `integration.model.build_prompt`), the expected answers,
the token-length target, the measured length and the depth of each inserted item (fraction of the
context's tokens that precede it). Lengths are counted with the tokenizer when one is given, else
estimated as one token per 4 characters. Each task has a scorer `score(sample, prediction) ->
float in [0, 1]`.

Tasks (RULER, Hsieh et al. 2024; LongEval, Li et al. 2023 as used in Sec. 3.2 of "SubGen: Token
Generation in Sublinear Time and Memory", arXiv:2402.06082):
- `niah_single`: one needle "One of the special magic {kind} for {key} is: {value}." with kind
  numbers (7 digits), words or UUIDs, in a haystack of filler sentences or real prose.
- `niah_multikey`: the asked needle among distractor needles with other keys.
- `niah_multivalue`: one key with several values; all must be returned.
- `niah_multiquery`: several needles, all asked.
- `variable_tracking`: "VAR X = 12345." then chained assignments "VAR Y = VAR X."; return every
  variable holding the value.
- `common_words`: a numbered word list where a few words are much more frequent; return them.
- `frequent_words`: words drawn from a Zipf law over made-up words; return the most frequent.
- `line_retrieval`: LongEval lines "line {topic}: REGISTER_CONTENT is <n>"; return n for a topic.
- `niah_prose`: one plain-English fact whose answer is a person's name or a town ("The archivist who
  catalogued the eastern collection was Margaret Okafor."), inserted into real prose and asked
  as a question ("Who catalogued the eastern collection?"); the answer is words, not digits.

Seeds: a sample's seed fixes it entirely. Seeds from `TUNING_SEEDS` (1000–1999) are kept for
choosing defaults (`benchmarks/tuning/`); reported runs use seeds below 1000 (the sweep's sample i
of `SweepConfig(seed=0)` has seed i), so no default is chosen on the samples it is reported on.
`niah_prose(split="tuning")` goes further: its tuning samples also draw their text, fact wordings, names
and towns from pools the reported samples never use (the standard library's docstrings instead of the
language reference, `TUNING_PROSE_FACTS`, `TUNING_FIRST_NAMES`, ...); in a sweep or the side-by-side
harness, `--task-param niah_prose.split=tuning` / `--task-param split=tuning` with tuning seeds.
`niah_prose(split="heldout")`, with seeds from `HELDOUT_SEEDS` (2000–2999), is a third set of pools shared with
neither: IDLE's user manual as the prose (`capture.manual_paragraphs`), `HELDOUT_PROSE_FACTS`, `HELDOUT_FIRST_NAMES`, ...,
kept for a final check that runs once, after every choice is made (`benchmarks/heldout/PLAN.md`).
`niah_prose(split="heldout2")`, seeds from `HELDOUT2_SEEDS` (3000–3999), is a fourth set of pools shared with none of
them, for a second final check (`benchmarks/heldout/PLAN2.md`): CPython's licence and IDLE's plain-text notes and news as
the prose (`capture.notes_paragraphs`), `HELDOUT2_PROSE_FACTS`, `HELDOUT2_FIRST_NAMES`, ...
`niah_prose(split="heldout3")`, seeds from `HELDOUT3_SEEDS` (4000–4999), is a fifth set of pools shared with none of
them, for a third final check: IDLE's 2.x news and IDLEfork's change log as the prose (`capture.changelog_paragraphs`),
`HELDOUT3_PROSE_FACTS`, `HELDOUT3_FIRST_NAMES`, ...
`niah_prose(split="heldout4")`, seeds from `HELDOUT4_SEEDS` (5000–5999), is a sixth set of pools shared with none of
them, for a fourth final check (`benchmarks/heldout/PLAN4.md`): the email package's architecture notes, IDLE's notes on its
tests and the docstrings of the email package's parsers as the prose (`capture.architecture_paragraphs`),
`HELDOUT4_PROSE_FACTS`, `HELDOUT4_FIRST_NAMES`, ...
`niah_prose(split="heldout5")`, seeds from `HELDOUT5_SEEDS` (6000–6999), is a seventh set of pools shared with none of
them, for a fifth final check (`benchmarks/heldout/PLAN5.md`): the docstrings of IDLE's own modules as the prose
(`capture.idle_source_paragraphs`), `HELDOUT5_PROSE_FACTS`, `HELDOUT5_FIRST_NAMES`, ...
`niah_prose(split="heldout6")`, seeds from `HELDOUT6_SEEDS` (7000–7999), is an eighth set of pools shared with none of
them, for a sixth final check (`benchmarks/heldout/PLAN6.md`): the docstrings of the modules of IDLE's features (its
search dialogs, shell, debugger, ...) as the prose (`capture.idle_feature_paragraphs`), `HELDOUT6_PROSE_FACTS`,
`HELDOUT6_FIRST_NAMES`, ...

The module imports the standard library only: kvpress's side of the side-by-side comparison loads it by path
(`benchmarks/kvpress_side_by_side.py`, in an environment without kvcompress).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import numbers
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
HAYSTACKS = ("filler", "prose")
NEEDLE_KINDS = ("numbers", "words", "uuids")
# Decoding room per needle value, in tokens: 7 digits (one token each) + space and period; a word;
# a 36-character UUID (the tokenizer splits hex runs finely: 27-37 tokens with SmolLM2's, 34 at the median).
NEEDLE_ANSWER_TOKENS = {"numbers": 10, "words": 6, "uuids": 40}
TASKS = (
    "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
    "variable_tracking", "common_words", "frequent_words", "line_retrieval", "niah_prose",
)
# Seeds for choosing defaults; reported runs use seeds below TUNING_SEEDS.start.
TUNING_SEEDS = range(1000, 2000)
# Seeds of the held-out needle set (niah_prose(split="heldout")), run once after every choice is made.
HELDOUT_SEEDS = range(2000, 3000)
# Seeds of the second held-out needle set (niah_prose(split="heldout2")), fixed before the first run on it.
HELDOUT2_SEEDS = range(3000, 4000)
# Seeds of the third held-out needle set (niah_prose(split="heldout3")), fixed before the first run on it.
HELDOUT3_SEEDS = range(4000, 5000)
# Seeds of the fourth held-out needle set (niah_prose(split="heldout4")), fixed before the first run on it.
HELDOUT4_SEEDS = range(5000, 6000)
# Seeds of the fifth held-out needle set (niah_prose(split="heldout5")), fixed before the first run on it.
HELDOUT5_SEEDS = range(6000, 7000)
# Seeds of the sixth held-out needle set (niah_prose(split="heldout6")), fixed before the first run on it.
HELDOUT6_SEEDS = range(7000, 8000)


@dataclass
class Sample:
    """One task instance.

    task: the generator's name (`TASKS`); context: the text to compress; question: what is asked about it;
    answers: every expected answer string; target_tokens: the context length asked of the generator;
    `depths`: for each inserted item (needle, assignment, target line) the fraction of context tokens
    before it, in insertion order (the asked one first where one is asked); needles: the inserted
    sentences, in the same order. n_tokens: the context's measured (or estimated) length. answer_prefix:
    text that starts the answer in a primed prompt layout (`integration.model.PromptLayout`); the
    prediction scored is what the model writes after the prompt. max_new_tokens: the answer's limit;
    stop: strings that end the answer where they appear.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    target_tokens: int
    n_tokens: int
    depths: list[float] = field(default_factory=list)
    needles: list[str] = field(default_factory=list)
    answer_prefix: str = ""
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()

    @property
    def depth(self) -> float | None:
        """Depth of the first (asked) item, or None for tasks without inserted items."""
        return self.depths[0] if self.depths else None


def token_counter(tokenizer=None) -> Callable[[Sequence[str]], list[float]]:
    """texts -> token counts: the tokenizer's (no special tokens), else the estimate len / 4."""
    if tokenizer is None:
        return lambda texts: [len(t) / 4 for t in texts]
    return lambda texts: [len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def _count(name: str, value, low: int, high: int | None = None, why: str = "") -> int:
    """An integer (Python's or NumPy's; not a bool, not a float) in [low, high] as an int, else a ValueError naming `name`
    and `why` (what the bound comes from)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low
            or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}{f' ({why})' if why else ''}, got {value!r}")
    return int(value)


def _real(name: str, value, low: float, high: float | None = None) -> float:
    """A finite real number (not a bool) in [low, high] as a float, else a ValueError naming `name`."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low
            or (high is not None and value > high)):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


# The most variables variable_tracking names: their random 5-letter names are all drawn again until none repeats, about
# exp(n² / (2 · 26⁵)) draws of n names (67 at 10,000; 10⁴⁰ at 100,000).
MAX_VARIABLES = 10_000
# frequent_words' made-up words: 3 consonants, a vowel, 2 consonants.
_MADE_UP_WORDS = 18**3 * 5 * 14**2
# The values kind "numbers" draws from (7 digits).
_NUMBERS = 9_000_000
_NEEDLE_COUNTS = ("n_keys", "n_values", "n_queries")


def check_task_params(task: str, params: dict, named: Callable[[str], str] = str) -> None:
    """A ValueError naming (as `named(name)`) the first of `params`, keyword arguments of the task's generator, that it
    refuses: a value of the wrong type or out of range, or more than it can draw (more keys than its vocabulary has
    words, more variables than `MAX_VARIABLES`). The generator's defaults stand for the arguments not given. What
    depends on the length is checked when a sample is built (a `target_tokens` too short for what is inserted).

    seed: an integer >= 0 (None would draw an unreproducible sample; -1 would repeat seed 1's). tokenizer: None (4
    characters a token) or a callable tokenizer as transformers' (texts -> {"input_ids": [...]})."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    a = {name: p.default for name, p in inspect.signature(GENERATORS[task]).parameters.items()} | dict(params)
    _count(named("target_tokens"), a["target_tokens"], 64)
    _count(named("seed"), a["seed"], 0)
    if "depth" in a:
        _real(named("depth"), a["depth"], 0.0, 1.0)
    if a["tokenizer"] is not None and not callable(a["tokenizer"]):
        raise ValueError(f"{named('tokenizer')} must be None (4 characters a token) or a tokenizer called as transformers' "
                         f"are (texts -> {{'input_ids': [...]}}), got {a['tokenizer']!r}")
    for name, choices in (("haystack", HAYSTACKS), ("kind", NEEDLE_KINDS), ("answer_kind", PROSE_ANSWER_KINDS),
                          ("split", tuple(PROSE_POOLS))):
        if name in a and (not isinstance(a[name], str) or a[name] not in choices):
            raise ValueError(f"{named(name)} must be one of {choices}, got {a[name]!r}")
    for name, low in (("n_keys", 2), ("n_values", 2), ("n_queries", 2), ("n_hops", 1), ("n_chains", 1), ("n_common", 1),
                      ("rare_freq", 1), ("n_answers", 1)):
        if name in a:
            _count(named(name), a[name], low)
    if "common_freq" in a:
        _count(named("common_freq"), a["common_freq"], a["rare_freq"] + 1, why=f"more than rare_freq={a['rare_freq']}")
    if "alpha" in a:
        _real(named("alpha"), a["alpha"], 1.0)
    if "vocab_size" in a:
        _count(named("vocab_size"), a["vocab_size"], a["n_answers"] + 1, _MADE_UP_WORDS,
               why=f"more than n_answers={a['n_answers']}, at most the {_MADE_UP_WORDS} made-up words there are")
    if a.get("n_lines") is not None:
        n_words = len(vocabulary())
        _count(named("n_lines"), a["n_lines"], 1, n_words**2, why=f"or None; each line's topic is a pair of the {n_words} vocabulary words")
    if task == "variable_tracking" and a["n_chains"] * (a["n_hops"] + 1) > MAX_VARIABLES:
        raise ValueError(f"{named('n_chains')} × ({named('n_hops')} + 1), the variables named, must be at most {MAX_VARIABLES} (their "
                         f"random names are drawn again until all differ), got {a['n_chains']} × ({a['n_hops']} + 1) = "
                         f"{a['n_chains'] * (a['n_hops'] + 1)}: at most {MAX_VARIABLES // (a['n_hops'] + 1)} chains of {a['n_hops']} hops")
    counted = next((name for name in _NEEDLE_COUNTS if name in a), None)
    if counted is not None:  # keys are distinct vocabulary words; "words" values are others, distinct too
        n_words = len(vocabulary())
        keys = counted != "n_values"  # n_keys and n_queries count keys, n_values one key's values
        words = a["kind"] == "words"
        if words:  # a key and its value(s) each take a word
            largest = n_words // 2 if keys else n_words - 1
        else:  # a key takes a word; uuids never run out
            largest = n_words if keys else _NUMBERS if a["kind"] == "numbers" else None
        if largest is not None and a[counted] > largest:
            source = f"the {n_words} vocabulary words" if keys or words else f"the {_NUMBERS} 7-digit numbers"
            raise ValueError(f"{named(counted)} must be at most {largest} with {a['kind']} as the values, got {a[counted]}: "
                             f"{'keys and values' if words else 'keys' if keys else 'values'} are distinct, drawn from {source}")


def _start(target_tokens, seed, tokenizer) -> tuple[random.Random, Callable[[Sequence[str]], list[float]]]:
    """A generator's first step after `check_task_params`: (its random stream for `seed`, its token counter)."""
    return random.Random(seed), token_counter(tokenizer)


# The real-prose haystack's source per split of niah_prose, in the order the splits were made: (split, the function of
# `capture` that gives its paragraphs, whether a sentence the source repeats is kept once). Each split's sentences are
# its source's less every sentence an earlier split's source has, so no two splits share a sentence; a new split goes
# last, which leaves every earlier split's sentences, and so its samples, as they were.
_PROSE_SOURCES = (
    ("reported", "prose_paragraphs", False),  # the Python language reference
    ("tuning", "docstring_paragraphs", False),  # the standard library's docstrings
    ("heldout", "manual_paragraphs", False),  # IDLE's user manual
    ("heldout2", "notes_paragraphs", False),  # CPython's licence and IDLE's notes
    ("heldout3", "changelog_paragraphs", False),  # IDLE's 2.x news and IDLEfork's change log
    ("heldout4", "architecture_paragraphs", True),  # the email package's architecture notes, IDLE's notes on its tests, ...
    ("heldout5", "idle_source_paragraphs", True),  # the docstrings of IDLE's own modules
    ("heldout6", "idle_feature_paragraphs", True),  # the docstrings of the modules of IDLE's features
)


@functools.lru_cache(maxsize=None)
def _prose_sentences(split: str = "reported") -> tuple[str, ...]:
    """The sentences of the real-prose haystack of `split` (`_PROSE_SOURCES`): its source's sentences of at least four
    words, less any sentence an earlier split's source has, in order (each once where the source is so marked). Only
    the sources up to `split`'s are read, each once (the earlier splits' sentences are this function's, cached).
    ValueError for a split not in `_PROSE_SOURCES`."""
    from . import capture

    names = [name for name, _, _ in _PROSE_SOURCES]
    if split not in names:
        raise ValueError(f"split must be one of {tuple(names)}, got {split!r}")
    index = names.index(split)
    _, source, once = _PROSE_SOURCES[index]
    earlier = set().union(*(_prose_sentences(name) for name in names[:index]))
    own = tuple(s for p in getattr(capture, source)() for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 4 and s not in earlier)
    return tuple(dict.fromkeys(own)) if once else own


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain lowercase English words (5–10 letters) of the real-prose source, sorted."""
    words = {w for s in _prose_sentences("reported") for w in re.findall(r"\b[a-z]{5,10}\b", s)}
    return tuple(sorted(words))


def _haystack_units(haystack: str, rng: random.Random, split: str = "reported") -> Callable[[int], list[str]]:
    """n -> the next n haystack sentences (filler cycles; prose starts at a random sentence of `split`'s source)."""
    if haystack == "filler":
        cycle = itertools.cycle(s + "." for s in FILLER.strip().rstrip(".").split(". "))
    elif haystack == "prose":
        sentences = _prose_sentences(split)
        start = rng.randrange(len(sentences))
        cycle = itertools.cycle(sentences[start:] + sentences[:start])
    else:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    return lambda n: list(itertools.islice(cycle, n))


def _assemble(units, items, item_depths, target_tokens, count, sep=" ", given="") -> tuple[str, list[float], int]:
    """Fill `target_tokens` with units from `units(n)` and insert `items` at `item_depths`.

    Returns (context, measured depth of each item, n_tokens). Items go between units, at the unit
    boundary nearest to depth × (tokens of the filled haystack). Items that alone take more than
    `target_tokens` are a ValueError naming `given` (the generator's parameter that sets how many, "n_lines=...").
    """
    room = target_tokens - sum(count([sep + t for t in items]))
    if room < 0:
        need = target_tokens - room
        raise ValueError(f"target_tokens={target_tokens} is shorter than the {len(items)} items inserted alone (about {round(need)} "
                         f"tokens; about {int(target_tokens * len(items) / need)} fit): "
                         f"{f'lower {given} or ' if given else ''}ask for a longer context")
    body: list[str] = []
    sizes: list[int] = []
    while sum(sizes) < room:
        more = units(max(16, int(room - sum(sizes)) // 8))
        body.extend(more)
        sizes.extend(count([sep + u for u in more]))
    cum = list(itertools.accumulate(sizes))
    while body and cum[-1] > room:
        body.pop()
        cum.pop()
    total = cum[-1] if cum else 0
    slots = [min(range(len(cum) + 1), key=lambda i: abs((cum[i - 1] if i else 0) - d * total)) for d in item_depths]
    pieces: list[str] = []
    order = sorted(range(len(items)), key=lambda j: (slots[j], j))
    nxt = 0
    for j in order:
        pieces.extend(body[nxt : slots[j]])
        nxt = slots[j]
        pieces.append(items[j])
    pieces.extend(body[nxt:])
    context = sep.join(pieces)
    n_tokens = round(count([context])[0])
    depths = []
    for j, item in enumerate(items):
        before = context[: context.index(item)]
        depths.append(count([before])[0] / n_tokens)
    return context, depths, n_tokens


def _needle_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "words":
        return rng.choice(vocabulary())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"kind must be one of {NEEDLE_KINDS}, got {kind!r}")


def _distinct_values(kind: str, rng: random.Random, n_keys: int, n_values: int, taken: set[str]) -> list[list[str]]:
    """n_values needle values for each of n_keys keys, none equal to another or to a `taken` word (the keys): a value
    drawn twice is drawn again (a draw with no repeat is the plain draw)."""
    values = []
    for _ in range(n_keys):
        row = []
        for _ in range(n_values):
            value = _needle_value(kind, rng)
            while value in taken:
                value = _needle_value(kind, rng)
            taken.add(value)
            row.append(value)
        values.append(row)
    return values


def _keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample(vocabulary(), n)


def _needle(kind: str, key: str, value: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _niah(task, target_tokens, depth, seed, tokenizer, haystack, kind, n_keys, n_values, n_queries) -> Sample:
    """RULER needle-in-a-haystack: n_keys keys (the first n_queries asked), n_values values each."""
    rng, count = _start(target_tokens, seed, tokenizer)
    units = _haystack_units(haystack, rng)
    keys = _keys(rng, n_keys)
    values = _distinct_values(kind, rng, len(keys), n_values, taken=set(keys))
    needles = [_needle(kind, k, v) for k, vs in zip(keys, values) for v in vs]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    given = {"niah_multikey": f"n_keys={n_keys}", "niah_multivalue": f"n_values={n_values}", "niah_multiquery": f"n_queries={n_queries}"}
    context, measured, n_tokens = _assemble(units, needles, depths, target_tokens, count, given=given.get(task, ""))
    asked = keys[:n_queries]
    answers = [v for vs in values[:n_queries] for v in vs]
    several = n_values * n_queries > 1
    what = f"are all the special magic {kind}" if several else f"is the special magic {kind[:-1]}"
    question = f"What {what} for {', '.join(asked)} mentioned in the provided text? Answer with the value only."
    prefix = f"The special magic {kind if several else kind[:-1]} for {', '.join(asked)} mentioned in the provided text {'are' if several else 'is'}"
    limit = len(answers) * NEEDLE_ANSWER_TOKENS[kind] + 4
    return Sample(task, context, question, answers, target_tokens, n_tokens, measured, needles, prefix, limit, (".", "\n"))


def niah_single(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, haystack="filler", kind="numbers") -> Sample:
    """One needle at `depth` (0 = start of the context, 1 = end)."""
    check_task_params("niah_single", locals())
    return _niah("niah_single", target_tokens, depth, seed, tokenizer, haystack, kind, 1, 1, 1)


def niah_multikey(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, haystack="filler", kind="numbers", n_keys=2) -> Sample:
    """The asked needle at `depth` plus n_keys − 1 distractor needles with other keys at random depths."""
    check_task_params("niah_multikey", locals())
    return _niah("niah_multikey", target_tokens, depth, seed, tokenizer, haystack, kind, n_keys, 1, 1)


def niah_multivalue(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, haystack="filler", kind="numbers", n_values=2) -> Sample:
    """n_values needles with the same key (the first at `depth`); all values are expected."""
    check_task_params("niah_multivalue", locals())
    return _niah("niah_multivalue", target_tokens, depth, seed, tokenizer, haystack, kind, 1, n_values, 1)


def niah_multiquery(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, haystack="filler", kind="numbers", n_queries=2) -> Sample:
    """n_queries needles with different keys (the first at `depth`), all asked."""
    check_task_params("niah_multiquery", locals())
    return _niah("niah_multiquery", target_tokens, depth, seed, tokenizer, haystack, kind, n_queries, 1, n_queries)


def variable_tracking(target_tokens=2048, depth=0.2, seed=0, tokenizer=None, haystack="filler", n_hops=4, n_chains=2) -> Sample:
    """n_chains assignment chains of n_hops hops spread through the haystack; the first is asked.

    The asked chain's first assignment sits at `depth`, its later hops at increasing random depths.
    """
    check_task_params("variable_tracking", locals())
    rng, count = _start(target_tokens, seed, tokenizer)
    names = ["".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in range(n_chains * (n_hops + 1))]
    while len(set(names)) < len(names):
        names = ["".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for _ in names]
    values = rng.sample(range(10_000, 100_000), n_chains)
    items, depths = [], []
    for c in range(n_chains):
        chain = names[c * (n_hops + 1) : (c + 1) * (n_hops + 1)]
        start = depth if c == 0 else rng.random() * 0.5
        hop_depths = sorted(rng.uniform(start, 1.0) for _ in range(n_hops))
        items += [f"VAR {chain[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        depths += [start] + hop_depths
    context, measured, n_tokens = _assemble(_haystack_units(haystack, rng), items, depths, target_tokens, count,
                                            given=f"n_chains={n_chains} or n_hops={n_hops}")
    question = (
        f"Find all variables that are assigned the value {values[0]} in the text above, "
        "directly or through other variables. Answer with the variable names only."
    )
    limit = 6 * (n_hops + 1) + 10
    return Sample("variable_tracking", context, question, names[: n_hops + 1], target_tokens, n_tokens, measured, items, max_new_tokens=limit)


def common_words(target_tokens=2048, seed=0, tokenizer=None, n_common=10, common_freq=30, rare_freq=3) -> Sample:
    """RULER CWE: n_common words appear common_freq times each, filler words rare_freq times each.

    The rare words fill the rest of the length (estimated per numbered word, then measured on the list and estimated
    again, so that the labels' growing digits count), shuffled with the common ones; a length shorter than the common
    words alone is an error (with the defaults, about 1,700 tokens of the default model's tokenizer).
    """
    check_task_params("common_words", locals())
    rng, count = _start(target_tokens, seed, tokenizer)
    vocab = list(vocabulary())
    rng.shuffle(vocab)
    common, rare_pool = vocab[:n_common], vocab[n_common:]
    per_word = sum(count([f" {i + 100}. {w}" for i, w in enumerate(vocab[:50])])) / 50
    floor = n_common * common_freq * per_word
    if floor > target_tokens:
        raise ValueError(f"target_tokens={target_tokens} is shorter than the common words alone: n_common={n_common} words "
                         f"× common_freq={common_freq} take about {round(floor)} tokens; lower them (a task parameter, "
                         f"--task-param common_words.common_freq=...) or ask for a longer context")

    def listed(per_word: float) -> list[str]:
        n_rare = max(0, (int(target_tokens / per_word) - n_common * common_freq) // rare_freq)
        if n_rare > len(rare_pool):
            raise ValueError(f"target_tokens too large for the vocabulary ({len(rare_pool)} rare words)")
        return common * common_freq + rare_pool[:n_rare] * rare_freq

    def numbered(words: list[str]) -> str:
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    words = listed(per_word)  # by the estimate per word, then by the tokens a word took in the list it gave
    words = listed(count([numbered(words)])[0] / len(words))
    rng.shuffle(words)
    context = numbered(words)
    n_tokens = round(count([context])[0])
    question = f"What are the {n_common} most common words in the numbered list above? Answer with the words only."
    return Sample("common_words", context, question, common, target_tokens, n_tokens, max_new_tokens=6 * n_common + 4)


def frequent_words(target_tokens=2048, seed=0, tokenizer=None, n_answers=3, alpha=2.0, vocab_size=500) -> Sample:
    """RULER FWE: made-up words drawn from a Zipf law (P(rank r) ∝ r^-alpha); return the n_answers most frequent."""
    check_task_params("frequent_words", locals())
    rng, count = _start(target_tokens, seed, tokenizer)
    made_up = set()
    while len(made_up) < vocab_size:
        made_up.add("".join(rng.choices("bcdfghjklmnprstvwz", k=3)) + rng.choice("aeiou") + "".join(rng.choices("bcdfghklmnprst", k=2)))
    made_up = sorted(made_up)
    rng.shuffle(made_up)
    weights = [(r + 1) ** -alpha for r in range(vocab_size)]
    per_word = sum(w * n for w, n in zip(weights, count([" " + w for w in made_up]))) / sum(weights)  # as drawn: by Zipf weight
    words = rng.choices(made_up, weights=weights, k=max(1, int(target_tokens / per_word)))
    measured = count([" ".join(words)])[0]
    if measured > target_tokens:  # the draw's own words ran long: the first that fit
        words = words[: max(1, int(len(words) * target_tokens / measured))]
    freq = {w: words.count(w) for w in set(words)}
    ranked = sorted(freq, key=lambda w: (-freq[w], made_up.index(w)))
    while len(ranked) > n_answers and freq[ranked[n_answers - 1]] == freq[ranked[n_answers]]:
        words.append(ranked[n_answers - 1])
        freq[ranked[n_answers - 1]] += 1
        ranked = sorted(freq, key=lambda w: (-freq[w], made_up.index(w)))
    context = " ".join(words)
    question = (
        f"What are the {n_answers} most frequently appearing words in the text above? Answer with the words only."
    )
    return Sample("frequent_words", context, question, ranked[:n_answers], target_tokens, round(count([context])[0]),
                  max_new_tokens=8 * n_answers + 8)


def line_retrieval(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, n_lines=None, haystack="filler") -> Sample:
    """LongEval lines 'line {adjective-noun}: REGISTER_CONTENT is <{number}>'; ask the line at `depth`.

    n_lines None: the context is nothing but lines (LongEval's dense form). n_lines k >= 1: k lines
    spread through a `haystack` (the asked one at `depth`, the others at random depths), for models
    too small to retrieve among hundreds of near-identical lines.
    """
    check_task_params("line_retrieval", locals())
    rng, count = _start(target_tokens, seed, tokenizer)
    vocab = vocabulary()
    if n_lines is None:
        per_line = count([f"line {vocab[0]}-{vocab[1]}: REGISTER_CONTENT is <12345>"])[0] + 1
        wanted = max(2, int(target_tokens // per_line))
    else:
        wanted = n_lines
    topics: set[str] = set()
    while len(topics) < wanted:
        topics.add(f"{rng.choice(vocab)}-{rng.choice(vocab)}")
    ordered = sorted(topics)
    rng.shuffle(ordered)
    numbers = [rng.randrange(1, 50_000) for _ in ordered]
    lines = [f"line {t}: REGISTER_CONTENT is <{v}>" for t, v in zip(ordered, numbers)]
    if n_lines is None:
        text = "\n".join(lines)
        while len(lines) > 2 and count([text])[0] > target_tokens:
            lines.pop()
            text = "\n".join(lines)
        target = min(len(lines) - 1, round(depth * (len(lines) - 1)))
        measured = count([text[: text.index(lines[target])]])[0] / count([text])[0]
        n_tokens = round(count([text])[0])
    else:
        target = 0
        depths = [depth] + [rng.random() for _ in lines[1:]]
        text, found, n_tokens = _assemble(_haystack_units(haystack, rng), [ln + "." for ln in lines], depths, target_tokens, count,
                                          given=f"n_lines={n_lines}")
        measured = found[0]
    question = f"What is the REGISTER_CONTENT in line {ordered[target]}? I need the number."
    prefix = f"line {ordered[target]}: REGISTER_CONTENT is <"
    return Sample(
        "line_retrieval", text, question, [str(numbers[target])], target_tokens, n_tokens, [measured], [lines[target]], prefix,
        8, (">", "\n"),
    )


FIRST_NAMES = (
    "Margaret", "Tomasz", "Amara", "Kenji", "Ingrid", "Rafael", "Leila", "Dmitri", "Nkechi", "Elena",
    "Oskar", "Priya", "Mateo", "Siobhan", "Hamid", "Astrid", "Beatriz", "Emeka", "Freya", "Lorenzo",
    "Ayesha", "Nils", "Chiara", "Tariq", "Greta", "Kofi", "Yara", "Anselm", "Imogen", "Bartholomew",
)
SURNAMES = (
    "Okafor", "Lindqvist", "Moreau", "Takahashi", "Novak", "Brennan", "Castillo", "Haddad", "Kowalski", "Mensah",
    "Fischer", "Rahman", "Oyelaran", "Petrov", "Delacroix", "Nakamura", "Gallagher", "Ferreira", "Abernathy", "Szabo",
    "Valdez", "Eriksen", "Marchetti", "Adeyemi", "Holloway", "Varga", "Ishikawa", "Pemberton", "Sandoval", "Quennell",
)
TOWNS = (
    "Ashbourne", "Carrowmore", "Dunmere", "Elmsworth", "Fenwick", "Glenrothes", "Harrowgate", "Invergarry",
    "Kettleby", "Lindisfarne", "Marlow", "Northwold", "Okehampton", "Penrith", "Quarrington", "Redruth",
    "Saltash", "Thornbury", "Ulverston", "Wexcombe", "Yarrowdale", "Zennor", "Aldeburgh", "Brixham",
    "Cromarty", "Dornoch", "Eyemouth", "Fowey", "Grantown", "Helmsley", "Keswick", "Lechlade",
    "Nairn", "Portree", "Ruthin", "Tenby", "Wigtown", "Bideford", "Alnwick", "Kirkwall",
)
# (fact with a {} for the answer, question, RULER-style answer prefix) per answer kind.
PROSE_FACTS = {
    "names": (
        ("The archivist who catalogued the eastern collection was {}.", "Who catalogued the eastern collection?",
         "The eastern collection was catalogued by"),
        ("The engineer who repaired the old harbour crane was {}.", "Who repaired the old harbour crane?",
         "The old harbour crane was repaired by"),
        ("The surgeon who founded the river clinic was {}.", "Who founded the river clinic?", "The river clinic was founded by"),
        ("The composer who wrote the cathedral hymn was {}.", "Who wrote the cathedral hymn?", "The cathedral hymn was written by"),
        ("The gardener who planted the walled orchard was {}.", "Who planted the walled orchard?", "The walled orchard was planted by"),
        ("The teacher who opened the village school was {}.", "Who opened the village school?", "The village school was opened by"),
        ("The cartographer who drew the map of the northern coast was {}.", "Who drew the map of the northern coast?",
         "The map of the northern coast was drawn by"),
        ("The captain who sailed the first ferry to the islands was {}.", "Who sailed the first ferry to the islands?",
         "The first ferry to the islands was sailed by"),
    ),
    "places": (
        ("The annual lantern festival is held in {}.", "Where is the annual lantern festival held?",
         "The annual lantern festival is held in"),
        ("The oldest clock tower of the region stands in {}.", "Where does the oldest clock tower of the region stand?",
         "The oldest clock tower of the region stands in"),
        ("The guild built its first printing press in {}.", "Where did the guild build its first printing press?",
         "The guild built its first printing press in"),
        ("The rare blue orchid was first found near {}.", "Near which town was the rare blue orchid first found?",
         "The rare blue orchid was first found near"),
        ("The treaty between the two valleys was signed in {}.", "Where was the treaty between the two valleys signed?",
         "The treaty between the two valleys was signed in"),
        ("The famous glassworks of the north is in {}.", "Where is the famous glassworks of the north?",
         "The famous glassworks of the north is in"),
    ),
}
PROSE_ANSWER_KINDS = ("names", "places", "mixed")
# Tuning samples' own pools (niah_prose(split="tuning")): no name, town or fact wording of the reported pools above.
TUNING_FIRST_NAMES = (
    "Agnieszka", "Bram", "Cosima", "Dario", "Esther", "Farid", "Gwendolyn", "Hugo", "Isolde", "Jonas",
    "Kalinda", "Lucian", "Mireille", "Nikolai", "Odile", "Pavel", "Rosalind", "Stellan", "Thandiwe", "Ulrich",
    "Vesna", "Wilhelmina", "Xavier", "Yusuf", "Zofia", "Alaric", "Brigid", "Casimir", "Delphine", "Evander",
)
TUNING_SURNAMES = (
    "Achterberg", "Bellweather", "Czerny", "Dunleavy", "Esposito", "Fairbairn", "Hargreaves", "Iverson", "Jankowski",
    "Kavanagh", "Lindgren", "Mbeki", "Nightingale", "Olofsson", "Pellegrini", "Quigley", "Rasmussen", "Stavros", "Thorne",
    "Uchenna", "Vasquez", "Whitlock", "Yilmaz", "Zielinski", "Ashworth", "Blackwood", "Carrington", "Drummond", "Ellery",
    "Montague",
)
TUNING_TOWNS = (
    "Amesbury", "Bakewell", "Cockermouth", "Dunbar", "Evesham", "Falmouth", "Grasmere", "Hexham", "Ilfracombe", "Jedburgh",
    "Kendal", "Ludlow", "Malton", "Newquay", "Oban", "Pickering", "Ramsey", "Sedbergh", "Tobermory", "Uppingham",
    "Wells", "Whitby", "Appleby", "Beverley", "Clitheroe", "Dolgellau", "Ely", "Frome", "Glastonbury", "Hawes",
    "Ilkley", "Kelso", "Lynton", "Melrose", "Nantwich", "Oakham", "Peebles", "Rye", "Settle", "Thirsk",
)
TUNING_PROSE_FACTS = {
    "names": (
        ("The potter who glazed the chapel tiles was {}.", "Who glazed the chapel tiles?", "The chapel tiles were glazed by"),
        ("The mason who rebuilt the stone bridge was {}.", "Who rebuilt the stone bridge?", "The stone bridge was rebuilt by"),
        ("The botanist who named the mountain fern was {}.", "Who named the mountain fern?", "The mountain fern was named by"),
        ("The weaver who made the guild banner was {}.", "Who made the guild banner?", "The guild banner was made by"),
        ("The physician who ran the island hospital was {}.", "Who ran the island hospital?", "The island hospital was run by"),
        ("The painter who restored the abbey mural was {}.", "Who restored the abbey mural?", "The abbey mural was restored by"),
        ("The astronomer who charted the winter comet was {}.", "Who charted the winter comet?",
         "The winter comet was charted by"),
        ("The librarian who rescued the flooded archive was {}.", "Who rescued the flooded archive?",
         "The flooded archive was rescued by"),
    ),
    "places": (
        ("The spring horse fair takes place in {}.", "Where does the spring horse fair take place?",
         "The spring horse fair takes place in"),
        ("The last working windmill of the county turns in {}.", "Where does the last working windmill of the county turn?",
         "The last working windmill of the county turns in"),
        ("The society kept its first weather station in {}.", "Where did the society keep its first weather station?",
         "The society kept its first weather station in"),
        ("The silver brooch of the old queen was unearthed near {}.", "Near which town was the silver brooch of the old queen unearthed?",
         "The silver brooch of the old queen was unearthed near"),
        ("The peace between the two clans was agreed in {}.", "Where was the peace between the two clans agreed?",
         "The peace between the two clans was agreed in"),
        ("The largest rope works of the coast is in {}.", "Where is the largest rope works of the coast?",
         "The largest rope works of the coast is in"),
    ),
}
# Held-out samples' own pools (niah_prose(split="heldout")): no name, town or fact wording of the two sets above.
HELDOUT_FIRST_NAMES = (
    "Adaeze", "Benedikt", "Carmela", "Desmond", "Eleonora", "Florian", "Giedre", "Hector", "Ilse", "Joaquin",
    "Katarina", "Leopold", "Marisol", "Nestor", "Ottilie", "Perpetua", "Quentin", "Radomir", "Saoirse", "Tobias",
    "Ursula", "Valentin", "Wanjiru", "Ximena", "Yevgenia", "Zoltan", "Anouk", "Barnaby", "Clemence", "Dagny",
)
HELDOUT_SURNAMES = (
    "Abernethy", "Bocanegra", "Cholmondeley", "Dragomir", "Engstrom", "Fitzwilliam", "Grimaldi", "Halvorsen", "Ibekwe",
    "Jorgensen", "Kuznetsova", "Lockhart", "Mwangi", "Nordqvist", "Ostrowski", "Prendergast", "Radcliffe", "Sorensen",
    "Tremblay", "Umberfield", "Vanterpool", "Wetherby", "Yamamoto", "Zamora", "Ainsworth", "Birkenhead", "Cavendish",
    "Delacourt", "Everingham", "Featherstone",
)
HELDOUT_TOWNS = (
    "Abergavenny", "Berwick", "Chepstow", "Dunkeld", "Egremont", "Fishguard", "Gairloch", "Hawick", "Inveraray", "Kirkbean",
    "Lampeter", "Machynlleth", "Newtonmore", "Orford", "Padstow", "Rothbury", "Southwold", "Tavistock", "Ullapool",
    "Walberswick", "Aberfeldy", "Bamburgh", "Crail", "Dunster", "Elgin", "Forres", "Girvan", "Hay", "Ironbridge",
    "Kirkcudbright", "Llandeilo", "Moffat", "Newlyn", "Pitlochry", "Richmond", "Staithes", "Thurso", "Wivenhoe", "Beaumaris",
    "Cullen",
)
HELDOUT_PROSE_FACTS = {
    "names": (
        ("The shipwright who built the lifeboat of the estuary was {}.", "Who built the lifeboat of the estuary?",
         "The lifeboat of the estuary was built by"),
        ("The chemist who refined the dye of the valley mills was {}.", "Who refined the dye of the valley mills?",
         "The dye of the valley mills was refined by"),
        ("The judge who settled the quarry dispute was {}.", "Who settled the quarry dispute?", "The quarry dispute was settled by"),
        ("The baker who won the harvest prize was {}.", "Who won the harvest prize?", "The harvest prize was won by"),
        ("The sculptor who carved the fountain lions was {}.", "Who carved the fountain lions?", "The fountain lions were carved by"),
        ("The pilot who flew the first mail plane to the glen was {}.", "Who flew the first mail plane to the glen?",
         "The first mail plane to the glen was flown by"),
        ("The scholar who translated the border ballads was {}.", "Who translated the border ballads?",
         "The border ballads were translated by"),
        ("The nurse who ran the mountain field station was {}.", "Who ran the mountain field station?",
         "The mountain field station was run by"),
    ),
    "places": (
        ("The midsummer boat race starts in {}.", "Where does the midsummer boat race start?", "The midsummer boat race starts in"),
        ("The oldest covered market of the shire is in {}.", "Where is the oldest covered market of the shire?",
         "The oldest covered market of the shire is in"),
        ("The railway company laid its first track in {}.", "Where did the railway company lay its first track?",
         "The railway company laid its first track in"),
        ("The golden chalice of the abbot was hidden near {}.", "Near which town was the golden chalice of the abbot hidden?",
         "The golden chalice of the abbot was hidden near"),
        ("The charter of the fishing guild was sealed in {}.", "Where was the charter of the fishing guild sealed?",
         "The charter of the fishing guild was sealed in"),
        ("The great tapestry workshop of the west is in {}.", "Where is the great tapestry workshop of the west?",
         "The great tapestry workshop of the west is in"),
    ),
}
# The second held-out set's own pools (niah_prose(split="heldout2")): no name, town or fact wording of the three sets above.
HELDOUT2_FIRST_NAMES = (
    "Ambrose", "Bettina", "Cyprian", "Dorotea", "Emeric", "Fenella", "Gideon", "Hortense", "Ignatius", "Jolanta",
    "Kasimir", "Lavinia", "Mattias", "Noemi", "Orrin", "Philippa", "Reinhold", "Seraphina", "Thaddeus", "Ulrika",
    "Vitus", "Winifred", "Yannick", "Zenobia", "Aurelio", "Beatrix", "Corentin", "Drusilla", "Emrys", "Fiammetta",
)
HELDOUT2_SURNAMES = (
    "Applegarth", "Brackenbury", "Calloway", "Dunsmore", "Eckersley", "Fotheringham", "Harcourt", "Hollingworth", "Inchcape",
    "Jessop", "Kilbride", "Lindgrove", "Macready", "Netherwood", "Okonkwo", "Pellingham", "Quartermaine", "Rowntree",
    "Stanhope", "Trevelyan", "Underhill", "Villanueva", "Wolstenholme", "Yardley", "Zborowski", "Ashcombe", "Bramwell",
    "Coverdale", "Dimbleby", "Elphinstone",
)
HELDOUT2_TOWNS = (
    "Aberaeron", "Bala", "Buxton", "Corwen", "Cromer", "Dingwall", "Dunoon", "Eyam", "Fakenham", "Fochabers", "Golspie",
    "Holt", "Hoylake", "Ingleton", "Kington", "Kinross", "Lauder", "Lerwick", "Lydd", "Mallaig", "Minehead", "Nefyn",
    "Otley", "Oundle", "Presteigne", "Reeth", "Rhayader", "Rosemarkie", "Saltburn", "Sandwich", "Selkirk", "Tain", "Troon",
    "Usk", "Wooler", "Yarm", "Abersoch", "Ambleside", "Brora", "Conwy",
)
HELDOUT2_PROSE_FACTS = {
    "names": (
        ("The carpenter who repaired the harbour lighthouse was {}.", "Who repaired the harbour lighthouse?",
         "The harbour lighthouse was repaired by"),
        ("The composer who wrote the cathedral anthem was {}.", "Who wrote the cathedral anthem?", "The cathedral anthem was written by"),
        ("The surveyor who mapped the northern marshes was {}.", "Who mapped the northern marshes?",
         "The northern marshes were mapped by"),
        ("The teacher who founded the village school was {}.", "Who founded the village school?", "The village school was founded by"),
        ("The engineer who designed the canal locks was {}.", "Who designed the canal locks?", "The canal locks were designed by"),
        ("The gardener who planted the orchard of rare pears was {}.", "Who planted the orchard of rare pears?",
         "The orchard of rare pears was planted by"),
        ("The blacksmith who forged the town gates was {}.", "Who forged the town gates?", "The town gates were forged by"),
        ("The archaeologist who excavated the hill fort was {}.", "Who excavated the hill fort?", "The hill fort was excavated by"),
    ),
    "places": (
        ("The annual cheese fair is held in {}.", "Where is the annual cheese fair held?", "The annual cheese fair is held in"),
        ("The first public library of the region opened in {}.", "Where did the first public library of the region open?",
         "The first public library of the region opened in"),
        ("The old silver mine of the county is near {}.", "Near which town is the old silver mine of the county?",
         "The old silver mine of the county is near"),
        ("The lost bronze bell of the priory was found in {}.", "Where was the lost bronze bell of the priory found?",
         "The lost bronze bell of the priory was found in"),
        ("The wool merchants' guild held its meetings in {}.", "Where did the wool merchants' guild hold its meetings?",
         "The wool merchants' guild held its meetings in"),
        ("The largest clock tower of the coast stands in {}.", "Where does the largest clock tower of the coast stand?",
         "The largest clock tower of the coast stands in"),
    ),
}
# The third held-out set's own pools (niah_prose(split="heldout3")): no name, town or fact wording of the four sets above.
HELDOUT3_FIRST_NAMES = (
    "Alessandra", "Bartosz", "Celestine", "Dagmar", "Eamon", "Filippa", "Gaspard", "Henrietta", "Ilario", "Jadwiga",
    "Konstantin", "Lucasta", "Maximilian", "Nerys", "Octavian", "Paloma", "Rupert", "Sunniva", "Tancredi", "Una",
    "Vasilisa", "Wendeline", "Yolande", "Zebedee", "Augustin", "Brunhilde", "Crispin", "Domenica", "Ezekiel", "Fionnuala",
)
HELDOUT3_SURNAMES = (
    "Ackroyd", "Blenkinsop", "Cartwright", "Dewhurst", "Entwistle", "Fairweather", "Greenhalgh", "Hetherington",
    "Illingworth", "Jevons", "Kettlewell", "Merriweather", "Nettleship", "Oakenshaw", "Penhaligon", "Quarrie", "Rushworth",
    "Sowerby", "Tillotson", "Urquhart", "Vickery", "Wainwright", "Yelland", "Zarnecki", "Amberley", "Cropper", "Dinwiddie",
    "Lowther", "Mortimer", "Thistlethwaite",
)
HELDOUT3_TOWNS = (
    "Alston", "Bampton", "Cawdor", "Dulverton", "Edzell", "Fortrose", "Glossop", "Hathersage", "Irvine", "Jarrow",
    "Lynmouth", "Masham", "Narberth", "Olney", "Porlock", "Ravenglass", "Sheringham", "Tetbury", "Uig", "Wirksworth",
    "Yoxford", "Alford", "Brampton", "Callander", "Ellon", "Findhorn", "Hornsea", "Inverurie", "Kinloss", "Leyburn",
    "Marazion", "Nevern", "Portsoy", "Sedgefield", "Tarbert", "Wadebridge", "Beccles", "Clovelly", "Dalbeattie", "Helston",
)
HELDOUT3_PROSE_FACTS = {
    "names": (
        ("The clockmaker who mended the market hall clock was {}.", "Who mended the market hall clock?",
         "The market hall clock was mended by"),
        ("The poet who wrote the harvest ode was {}.", "Who wrote the harvest ode?", "The harvest ode was written by"),
        ("The stonecutter who carved the bridge parapet was {}.", "Who carved the bridge parapet?",
         "The bridge parapet was carved by"),
        ("The brewer who revived the abbey ale was {}.", "Who revived the abbey ale?", "The abbey ale was revived by"),
        ("The photographer who recorded the island lighthouses was {}.", "Who recorded the island lighthouses?",
         "The island lighthouses were recorded by"),
        ("The miller who rebuilt the tidal mill was {}.", "Who rebuilt the tidal mill?", "The tidal mill was rebuilt by"),
        ("The bellfounder who cast the minster bells was {}.", "Who cast the minster bells?", "The minster bells were cast by"),
        ("The organist who restored the chapel organ was {}.", "Who restored the chapel organ?",
         "The chapel organ was restored by"),
    ),
    "places": (
        ("The winter sheep sale is held in {}.", "Where is the winter sheep sale held?", "The winter sheep sale is held in"),
        ("The oldest packhorse bridge of the dale stands in {}.", "Where does the oldest packhorse bridge of the dale stand?",
         "The oldest packhorse bridge of the dale stands in"),
        ("The dairy cooperative opened its first creamery in {}.", "Where did the dairy cooperative open its first creamery?",
         "The dairy cooperative opened its first creamery in"),
        ("The hoard of Roman coins was uncovered near {}.", "Near which town was the hoard of Roman coins uncovered?",
         "The hoard of Roman coins was uncovered near"),
        ("The accord between the rival ferry companies was reached in {}.",
         "Where was the accord between the rival ferry companies reached?",
         "The accord between the rival ferry companies was reached in"),
        ("The finest boatyard of the firth is in {}.", "Where is the finest boatyard of the firth?",
         "The finest boatyard of the firth is in"),
    ),
}
# The fourth held-out set's own pools (niah_prose(split="heldout4")): no name, town or fact wording of the five sets above.
HELDOUT4_FIRST_NAMES = (
    "Annelise", "Bronislaw", "Cordelia", "Dorian", "Eulalia", "Fabian", "Genevieve", "Horatio", "Iolanthe", "Jeremiah",
    "Kerensa", "Lysander", "Magdalena", "Niamh", "Oswin", "Petronella", "Roderick", "Solveig", "Theodora", "Ulyana",
    "Vincenzo", "Wilfred", "Yseult", "Zacharias", "Anastasia", "Bertrand", "Constance", "Dariusz", "Esmeralda", "Ferdinand",
)
HELDOUT4_SURNAMES = (
    "Ashdown", "Bellingham", "Crabtree", "Dalrymple", "Edgeworth", "Farquharson", "Gillespie", "Huddleston", "Ingleby",
    "Jarvis", "Kirkpatrick", "Lovelock", "Mottram", "Northcote", "Ormerod", "Pilkington", "Quayle", "Ravenscroft",
    "Sutcliffe", "Treadwell", "Uttley", "Vanstone", "Whitworth", "Youngman", "Zwolinski", "Armitage", "Bickerstaff",
    "Catterall", "Duckworth", "Lumsden",
)
HELDOUT4_TOWNS = (
    "Arundel", "Brecon", "Crieff", "Dingle", "Ennis", "Faversham", "Gorey", "Harlech", "Innerleithen", "Kenmare",
    "Llanidloes", "Montrose", "Neath", "Oldmeldrum", "Pembroke", "Rothesay", "Skibbereen", "Totnes", "Uttoxeter", "Westport",
    "Youghal", "Alnmouth", "Bantry", "Clifden", "Dunblane", "Ledbury", "Kinsale", "Lewes", "Monmouth", "Nenagh",
    "Pwllheli", "Sherborne", "Stonehaven", "Tregaron", "Wareham", "Ballater", "Criccieth", "Haworth", "Lismore", "Sligo",
)
HELDOUT4_PROSE_FACTS = {
    "names": (
        ("The glazier who fitted the rose window was {}.", "Who fitted the rose window?", "The rose window was fitted by"),
        ("The thatcher who roofed the coaching inn was {}.", "Who roofed the coaching inn?", "The coaching inn was roofed by"),
        ("The saddler who stitched the hunt saddles was {}.", "Who stitched the hunt saddles?",
         "The hunt saddles were stitched by"),
        ("The cooper who shaped the cider barrels was {}.", "Who shaped the cider barrels?", "The cider barrels were shaped by"),
        ("The midwife who kept the parish birth register was {}.", "Who kept the parish birth register?",
         "The parish birth register was kept by"),
        ("The geologist who dated the cliff fossils was {}.", "Who dated the cliff fossils?", "The cliff fossils were dated by"),
        ("The architect who planned the corn exchange was {}.", "Who planned the corn exchange?",
         "The corn exchange was planned by"),
        ("The fiddler who collected the shepherds' reels was {}.", "Who collected the shepherds' reels?",
         "The shepherds' reels were collected by"),
    ),
    "places": (
        ("The autumn ploughing match is held in {}.", "Where is the autumn ploughing match held?",
         "The autumn ploughing match is held in"),
        ("The oldest Celtic cross of the peninsula stands in {}.", "Where does the oldest Celtic cross of the peninsula stand?",
         "The oldest Celtic cross of the peninsula stands in"),
        ("The beekeepers' association opened its first apiary in {}.",
         "Where did the beekeepers' association open its first apiary?",
         "The beekeepers' association opened its first apiary in"),
        ("The Viking sword was dug up near {}.", "Near which town was the Viking sword dug up?",
         "The Viking sword was dug up near"),
        ("The truce between the feuding drovers was struck in {}.", "Where was the truce between the feuding drovers struck?",
         "The truce between the feuding drovers was struck in"),
        ("The busiest tannery of the moorland is in {}.", "Where is the busiest tannery of the moorland?",
         "The busiest tannery of the moorland is in"),
    ),
}
# The fifth held-out set's own pools (niah_prose(split="heldout5")): no name, town or fact wording of the six sets above.
HELDOUT5_FIRST_NAMES = (
    "Adelheid", "Benedetta", "Cornelius", "Dominika", "Edmund", "Felicity", "Gregor", "Hildegard", "Ignacio", "Juliana",
    "Klaus", "Leonie", "Malcolm", "Nadia", "Orla", "Piotr", "Rosamund", "Sebastian", "Tamsin", "Umberto",
    "Verity", "Wolfgang", "Yvette", "Zuzana", "Aldous", "Bernadette", "Casper", "Edwina", "Frederik", "Harriet",
)
HELDOUT5_SURNAMES = (
    "Aldridge", "Blackmore", "Chadwick", "Eastwood", "Gresham", "Hawthorne", "Ironside", "Jennings", "Kingsley", "Langford",
    "Marchbanks", "Newcombe", "Oglethorpe", "Pennington", "Quincey", "Rutherford", "Saltonstall", "Tunstall", "Underwood",
    "Vernon", "Westbrook", "Yeoman", "Zajac", "Attwood", "Birtwistle", "Cresswell", "Dobson", "Fairclough", "Garside",
    "Holroyd",
)
HELDOUT5_TOWNS = (
    "Ashburton", "Bridport", "Dartmouth", "Hadleigh", "Lavenham", "Shaftesbury", "Swanage", "Tewkesbury", "Woodstock",
    "Aylsham", "Burford", "Holmfirth", "Marlborough", "Sidmouth", "Beaminster", "Axminster", "Whitstable", "Banchory",
    "Comrie", "Dufftown", "Huntly", "Kingussie", "Lochinver", "Portpatrick", "Tomintoul", "Brechin", "Lanark",
    "Crickhowell", "Llandovery", "Llangollen", "Beddgelert", "Adare", "Ballina", "Cahir", "Dungarvan", "Listowel", "Tramore",
    "Carlingford", "Kilkee", "Stamford",
)
HELDOUT5_PROSE_FACTS = {
    "names": (
        ("The wheelwright who built the carnival wagons was {}.", "Who built the carnival wagons?",
         "The carnival wagons were built by"),
        ("The embroiderer who sewed the regimental colours was {}.", "Who sewed the regimental colours?",
         "The regimental colours were sewn by"),
        ("The jeweller who set the mayor's chain was {}.", "Who set the mayor's chain?", "The mayor's chain was set by"),
        ("The engraver who cut the borough seal was {}.", "Who cut the borough seal?", "The borough seal was cut by"),
        ("The vintner who laid out the hillside vineyard was {}.", "Who laid out the hillside vineyard?",
         "The hillside vineyard was laid out by"),
        ("The naturalist who surveyed the puffin colony was {}.", "Who surveyed the puffin colony?",
         "The puffin colony was surveyed by"),
        ("The editor who founded the weekly gazette was {}.", "Who founded the weekly gazette?",
         "The weekly gazette was founded by"),
        ("The falconer who trained the castle hawks was {}.", "Who trained the castle hawks?", "The castle hawks were trained by"),
    ),
    "places": (
        ("The spring sheepdog trials are held in {}.", "Where are the spring sheepdog trials held?",
         "The spring sheepdog trials are held in"),
        ("The tallest spire of the diocese rises in {}.", "Where does the tallest spire of the diocese rise?",
         "The tallest spire of the diocese rises in"),
        ("The rowing club built its first boathouse in {}.", "Where did the rowing club build its first boathouse?",
         "The rowing club built its first boathouse in"),
        ("The gold torc of the chieftain was turned up near {}.", "Near which town was the gold torc of the chieftain turned up?",
         "The gold torc of the chieftain was turned up near"),
        ("The agreement between the neighbouring estates was concluded in {}.",
         "Where was the agreement between the neighbouring estates concluded?",
         "The agreement between the neighbouring estates was concluded in"),
        ("The busiest salmon fishery of the river is in {}.", "Where is the busiest salmon fishery of the river?",
         "The busiest salmon fishery of the river is in"),
    ),
}
# The sixth held-out set's own pools (niah_prose(split="heldout6")): no name, town or fact wording of the seven sets above.
HELDOUT6_FIRST_NAMES = (
    "Agatha", "Bastian", "Clementine", "Declan", "Elspeth", "Fergus", "Gwilym", "Honoria", "Isidore", "Jessamy",
    "Kasia", "Lorcan", "Marguerite", "Nathaniel", "Ottoline", "Perdita", "Rhiannon", "Silvester", "Tabitha", "Wenceslas",
    "Xanthe", "Yorick", "Zinnia", "Alasdair", "Cressida", "Evangeline", "Godfrey", "Mirabel", "Torquil", "Percival",
)
HELDOUT6_SURNAMES = (
    "Ackerley", "Braithwaite", "Cottingham", "Davenport", "Eversley", "Gilchrist", "Hesketh", "Horsfall", "Jardine",
    "Kershaw", "Lockwood", "Mansergh", "Nuttall", "Openshaw", "Ogden", "Rawlinson", "Ramsden", "Thwaites", "Venables",
    "Whittaker", "Crowther", "Broadbent", "Culshaw", "Kenyon", "Greenwood", "Haslam", "Marsden", "Walmsley", "Tattersall",
    "Wrigley",
)
HELDOUT6_TOWNS = (
    "Thame", "Bridgnorth", "Malmesbury", "Pershore", "Tadcaster", "Wantage", "Lostwithiel", "Appledore", "Hawkshead",
    "Corbridge", "Matlock", "Pocklington", "Middleham", "Guisborough", "Aberlour", "Forfar", "Carnoustie", "Alyth", "Aboyne",
    "Plockton", "Braemar", "Killin", "Anstruther", "Banff", "Cowbridge", "Denbigh", "Penarth", "Barmouth", "Tywyn",
    "Talgarth", "Knighton", "Kidwelly", "Athy", "Cobh", "Cashel", "Birr", "Ardara", "Lahinch", "Tuam", "Kells",
)
HELDOUT6_PROSE_FACTS = {
    "names": (
        ("The locksmith who made the treasury keys was {}.", "Who made the treasury keys?", "The treasury keys were made by"),
        ("The tailor who cut the judges' robes was {}.", "Who cut the judges' robes?", "The judges' robes were cut by"),
        ("The shepherd who bred the hardy mountain ewes was {}.", "Who bred the hardy mountain ewes?",
         "The hardy mountain ewes were bred by"),
        ("The printer who published the county almanac was {}.", "Who published the county almanac?",
         "The county almanac was published by"),
        ("The lacemaker who trimmed the bridal veil was {}.", "Who trimmed the bridal veil?", "The bridal veil was trimmed by"),
        ("The quarryman who cut the granite for the pier was {}.", "Who cut the granite for the pier?",
         "The granite for the pier was cut by"),
        ("The ranger who guarded the ancient forest was {}.", "Who guarded the ancient forest?",
         "The ancient forest was guarded by"),
        ("The historian who wrote the town chronicle was {}.", "Who wrote the town chronicle?",
         "The town chronicle was written by"),
    ),
    "places": (
        ("The summer regatta is held in {}.", "Where is the summer regatta held?", "The summer regatta is held in"),
        ("The oldest holy well of the valley lies in {}.", "Where does the oldest holy well of the valley lie?",
         "The oldest holy well of the valley lies in"),
        ("The choral society gave its first concert in {}.", "Where did the choral society give its first concert?",
         "The choral society gave its first concert in"),
        ("The carved whalebone comb was dredged up near {}.", "Near which town was the carved whalebone comb dredged up?",
         "The carved whalebone comb was dredged up near"),
        ("The pact between the quarrelling parishes was made in {}.",
         "Where was the pact between the quarrelling parishes made?",
         "The pact between the quarrelling parishes was made in"),
        ("The busiest slate quarry of the district is in {}.", "Where is the busiest slate quarry of the district?",
         "The busiest slate quarry of the district is in"),
    ),
}
# split -> (first names, surnames, towns, facts) of niah_prose
PROSE_POOLS = {
    "reported": (FIRST_NAMES, SURNAMES, TOWNS, PROSE_FACTS),
    "tuning": (TUNING_FIRST_NAMES, TUNING_SURNAMES, TUNING_TOWNS, TUNING_PROSE_FACTS),
    "heldout": (HELDOUT_FIRST_NAMES, HELDOUT_SURNAMES, HELDOUT_TOWNS, HELDOUT_PROSE_FACTS),
    "heldout2": (HELDOUT2_FIRST_NAMES, HELDOUT2_SURNAMES, HELDOUT2_TOWNS, HELDOUT2_PROSE_FACTS),
    "heldout3": (HELDOUT3_FIRST_NAMES, HELDOUT3_SURNAMES, HELDOUT3_TOWNS, HELDOUT3_PROSE_FACTS),
    "heldout4": (HELDOUT4_FIRST_NAMES, HELDOUT4_SURNAMES, HELDOUT4_TOWNS, HELDOUT4_PROSE_FACTS),
    "heldout5": (HELDOUT5_FIRST_NAMES, HELDOUT5_SURNAMES, HELDOUT5_TOWNS, HELDOUT5_PROSE_FACTS),
    "heldout6": (HELDOUT6_FIRST_NAMES, HELDOUT6_SURNAMES, HELDOUT6_TOWNS, HELDOUT6_PROSE_FACTS),
}
# split -> the seeds it takes (the reported split: any seed; reported runs use seeds below TUNING_SEEDS.start)
SPLIT_SEEDS = {"tuning": TUNING_SEEDS, "heldout": HELDOUT_SEEDS, "heldout2": HELDOUT2_SEEDS, "heldout3": HELDOUT3_SEEDS,
               "heldout4": HELDOUT4_SEEDS, "heldout5": HELDOUT5_SEEDS, "heldout6": HELDOUT6_SEEDS}


def niah_prose(target_tokens=2048, depth=0.5, seed=0, tokenizer=None, answer_kind="mixed", split="reported") -> Sample:
    """One fact whose answer is a full name (first name × surname) or a town, at `depth` in real prose.

    answer_kind "names" or "places" fixes the kind; "mixed" draws it per seed (half each on
    average). The question asks for the fact without repeating it; the sample's answer prefix
    restates it up to the answer (RULER's convention, written only by a primed prompt layout). The
    score is whether the whole answer appears in the prediction (case-insensitive, whole words).

    split "reported" (the default) draws from the reported pools: the Python language reference's prose, `PROSE_FACTS`,
    `FIRST_NAMES`, `SURNAMES`, `TOWNS`. split "tuning", for choosing defaults, draws from pools that share nothing with
    them: the standard library's docstrings (no sentence of the reference), `TUNING_PROSE_FACTS`, `TUNING_FIRST_NAMES`,
    `TUNING_SURNAMES`, `TUNING_TOWNS`; it takes only seeds from `TUNING_SEEDS`. split "heldout", for the final check
    run once after every choice, draws from a third set of pools shared with neither: IDLE's user manual,
    `HELDOUT_PROSE_FACTS`, `HELDOUT_FIRST_NAMES`, `HELDOUT_SURNAMES`, `HELDOUT_TOWNS`; seeds from `HELDOUT_SEEDS` only.
    split "heldout2", for a second final check, draws from a fourth set shared with none of them: CPython's licence and
    IDLE's plain-text notes, `HELDOUT2_PROSE_FACTS`, `HELDOUT2_FIRST_NAMES`, `HELDOUT2_SURNAMES`, `HELDOUT2_TOWNS`; seeds
    from `HELDOUT2_SEEDS` only.
    split "heldout3", for a third final check, draws from a fifth set shared with none of them: IDLE's 2.x news and
    IDLEfork's change log, `HELDOUT3_PROSE_FACTS`, `HELDOUT3_FIRST_NAMES`, `HELDOUT3_SURNAMES`, `HELDOUT3_TOWNS`; seeds
    from `HELDOUT3_SEEDS` only.
    split "heldout4", for a fourth final check (`benchmarks/heldout/PLAN4.md`), draws from a sixth set shared with none of
    them: the email package's architecture notes, IDLE's notes on its tests and the email package's parsers' docstrings,
    `HELDOUT4_PROSE_FACTS`, `HELDOUT4_FIRST_NAMES`, `HELDOUT4_SURNAMES`, `HELDOUT4_TOWNS`; seeds from `HELDOUT4_SEEDS` only.
    split "heldout5", for a fifth final check (`benchmarks/heldout/PLAN5.md`), draws from a seventh set shared with none of
    them: the docstrings of IDLE's own modules, `HELDOUT5_PROSE_FACTS`, `HELDOUT5_FIRST_NAMES`, `HELDOUT5_SURNAMES`,
    `HELDOUT5_TOWNS`; seeds from `HELDOUT5_SEEDS` only.
    split "heldout6", for a sixth final check (`benchmarks/heldout/PLAN6.md`), draws from an eighth set shared with none
    of them: the docstrings of the modules of IDLE's features (its search dialogs, shell, debugger, ...), `HELDOUT6_PROSE_FACTS`,
    `HELDOUT6_FIRST_NAMES`, `HELDOUT6_SURNAMES`, `HELDOUT6_TOWNS`; seeds from `HELDOUT6_SEEDS` only.
    """
    check_task_params("niah_prose", locals())
    if split in SPLIT_SEEDS and seed not in SPLIT_SEEDS[split]:
        seeds = SPLIT_SEEDS[split]
        raise ValueError(f"split={split!r} takes seeds from {split.upper()}_SEEDS ({seeds.start}..{seeds.stop - 1}), got seed={seed!r}")
    first_names, surnames, towns, facts = PROSE_POOLS[split]
    rng = random.Random(seed)
    kind = rng.choice(("names", "places")) if answer_kind == "mixed" else answer_kind
    fact, question, prefix = rng.choice(facts[kind])
    answer = f"{rng.choice(first_names)} {rng.choice(surnames)}" if kind == "names" else rng.choice(towns)
    needle = fact.format(answer)
    units = _haystack_units("prose", rng, split)
    context, measured, n_tokens = _assemble(units, [needle], [depth], target_tokens, token_counter(tokenizer))
    return Sample("niah_prose", context, question, [answer], target_tokens, n_tokens, measured, [needle], prefix, 24, (".", "\n"))


GENERATORS: dict[str, Callable[..., Sample]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "niah_multiquery": niah_multiquery,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "frequent_words": frequent_words,
    "line_retrieval": line_retrieval,
    "niah_prose": niah_prose,
}


def task_parameters(task: str) -> frozenset[str]:
    """Names of the parameters the task's generator takes (e.g. "depth", "haystack", "kind")."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return frozenset(inspect.signature(GENERATORS[task]).parameters)


def generate_sample(task: str, **kwargs) -> Sample:
    """Build one sample of the named task (keyword arguments go to its generator)."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return GENERATORS[task](**kwargs)


def _check_prediction(prediction) -> None:
    if not isinstance(prediction, str):
        raise ValueError(f"prediction must be a string (the model's answer; '' for none), got {prediction!r}")


def whole_words_found(answers: Sequence[str], prediction: str) -> float:
    """Fraction of expected answers found in the prediction as whole words (case-insensitive): the synthetic tasks'
    score, stricter than RULER's `metrics.string_match_all`, which counts any substring. No answers is a ValueError."""
    _check_prediction(prediction)
    if isinstance(answers, str) or not answers:
        raise ValueError(f"answers must be a non-empty list of the expected answers, got {answers!r}")
    pred = prediction.lower()
    found = sum(bool(re.search(rf"(?<![\w-]){re.escape(a.lower())}(?![\w-])", pred)) for a in answers)
    return found / len(answers)


def score(sample: Sample, prediction: str) -> float:
    """Task score in [0, 1]: the share of the answers found as whole words (`whole_words_found`), or for
    line_retrieval whether the prediction's first integer is the answer (LongEval's own scorer reads the last; the
    primed answer starts with the number, so the first is the one answered, and a later one is the model's own text)."""
    _check_prediction(prediction)
    if sample.task == "line_retrieval":
        found = re.search(r"\d+", prediction)
        return float(found is not None and found.group(0) == sample.answers[0])
    return whole_words_found(sample.answers, prediction)
