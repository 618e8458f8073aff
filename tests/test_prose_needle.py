"""The prose needle (`niah_prose`): a name or a town stated once in real prose, asked for by a question."""

import gzip
import importlib.util
import json
import re
from pathlib import Path

import pytest

from kvcompress.eval import tasks as T
from kvcompress.eval.runner import SweepConfig, sample_specs

ROOT = Path(__file__).resolve().parents[1]
# The module whose EXTRA_MODULES list the extra text KVzap's inputs were tuned on (read as text: it imports torch).
SCORER_INPUTS = ROOT / "benchmarks" / "tuning" / "scorer_inputs.py"


# The held-out splits' text is IDLE's (its manual, notes and modules), which some distributions package apart from
# CPython (Debian's idle-python3.x): without it the library refuses those splits by name, and these tests cannot run.
needs_idle = pytest.mark.skipif(importlib.util.find_spec("idlelib") is None,
                                reason="this Python ships no idlelib, whose text the held-out splits read (install e.g. idle-python3)")


def _extra_modules() -> tuple[str, ...]:
    """benchmarks/tuning/scorer_inputs.py's EXTRA_MODULES."""
    return tuple(re.search(r'EXTRA_MODULES = tuple\("""(.*?)"""', SCORER_INPUTS.read_text(encoding="utf-8"), re.S).group(1).split())


@pytest.mark.parametrize("answer_kind", ["names", "places"])
@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_the_fact_sits_once_at_its_depth_in_real_prose(answer_kind, depth):
    s = T.niah_prose(1200, depth, seed=7, answer_kind=answer_kind)
    (answer,) = s.answers
    (needle,) = s.needles
    facts = {fact.format(answer): (question, prefix) for fact, question, prefix in T.PROSE_FACTS[answer_kind]}
    assert needle in facts and facts[needle] == (s.question, s.answer_prefix)
    assert s.context.count(needle) == 1 and s.context.count(answer) == 1
    assert abs(s.context.index(needle) / len(s.context) - depth) < 0.05 and abs(s.depth - depth) < 0.05
    assert abs(s.n_tokens - 1200) < 60
    haystack = s.context.replace(needle, "").strip()
    assert any(haystack.startswith(sentence) for sentence in T._prose_sentences())  # the rest is the shipped prose
    if answer_kind == "names":
        first, last = answer.split(" ")
        assert first in T.FIRST_NAMES and last in T.SURNAMES and s.question.startswith("Who")
    else:
        assert answer in T.TOWNS and answer not in s.question
    assert answer not in s.question + s.answer_prefix  # the question and the prefix do not give it away
    assert s.stop == (".", "\n") and s.max_new_tokens == 24


def test_scored_on_the_whole_answer_case_and_spacing_aside():
    s = T.niah_prose(600, 0.5, seed=3, answer_kind="names")
    first, last = s.answers[0].split(" ")
    assert T.score(s, f"The eastern collection was catalogued by {first.upper()} {last}.") == 1.0
    assert T.score(s, f"{first} {last}") == 1.0
    assert T.score(s, first) == 0.0 and T.score(s, last) == 0.0
    assert T.score(s, f"{first}{last}") == 0.0


def test_same_seed_same_sample_and_mixed_draws_both_kinds():
    assert T.niah_prose(500, 0.3, seed=11) == T.niah_prose(500, 0.3, seed=11)
    samples = [T.niah_prose(300, 0.5, seed=seed) for seed in range(40)]
    assert len({s.answers[0] for s in samples}) > 30
    kinds = {"names" if re.match(r"Who ", s.question) else "places" for s in samples}
    assert kinds == {"names", "places"}


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match=r"answer_kind must be one of \('names', 'places', 'mixed'\), got 'towns'"):
        T.niah_prose(500, answer_kind="towns")
    with pytest.raises(ValueError, match=r"depth must be a finite number in \[0.0, 1.0\], got 1.5"):
        T.niah_prose(500, depth=1.5)


def test_in_the_default_sweep_beside_the_filler_needle_and_lines():
    assert {"niah_prose", "niah_single", "line_retrieval"} <= set(SweepConfig().tasks)
    config = SweepConfig(methods=[], tasks=["niah_prose"], lengths=[300], samples=2, task_params={"niah_prose": {"answer_kind": "places"}})
    built = [spec.build(config, None) for spec in sample_specs(config)]
    assert all(s.answers[0] in T.TOWNS for s in built) and built[0].answers != built[1].answers


def test_tuning_seeds_lie_above_the_reported_ones():
    assert T.TUNING_SEEDS.start == 1000 and len(T.TUNING_SEEDS) == 1000
    assert SweepConfig().seed + SweepConfig().samples <= T.TUNING_SEEDS.start


def test_tuning_samples_share_no_text_wording_or_answer_with_the_reported_ones():
    """split="tuning" (the issue's tuning cases: seeds, texts and needle wordings disjoint from the reported ones)."""
    reported, tuning = set(T._prose_sentences("reported")), set(T._prose_sentences("tuning"))
    assert len(tuning) > 1000 and not reported & tuning
    for kind in ("names", "places"):
        wordings = {part for fact in T.PROSE_FACTS[kind] for part in fact}
        assert not wordings & {part for fact in T.TUNING_PROSE_FACTS[kind] for part in fact}
    assert not set(T.FIRST_NAMES) & set(T.TUNING_FIRST_NAMES) and not set(T.SURNAMES) & set(T.TUNING_SURNAMES)
    assert not set(T.TOWNS) & set(T.TUNING_TOWNS)
    for seed in (1000, 1001, 1502):
        s = T.niah_prose(900, 0.5, seed=seed, split="tuning")
        (needle,) = s.needles
        first_names, surnames, towns, facts = T.PROSE_POOLS["tuning"]
        kind = "names" if s.question.startswith("Who") else "places"
        assert any(needle == fact.format(s.answers[0]) and s.question == question for fact, question, _ in facts[kind])
        assert set(s.answers[0].split(" ")) <= set(first_names + surnames + towns)
        haystack = s.context.replace(needle, "").strip()
        assert any(haystack.startswith(sentence) for sentence in tuning)
        assert s == T.niah_prose(900, 0.5, seed=seed, split="tuning")
    # the reported split is the default and draws what it always drew
    assert T.niah_prose(700, 0.2, seed=1005) == T.niah_prose(700, 0.2, seed=1005, split="reported")


def test_the_tuning_split_takes_only_tuning_seeds():
    with pytest.raises(ValueError, match=r"split='tuning' takes seeds from TUNING_SEEDS \(1000..1999\), got seed=3"):
        T.niah_prose(500, seed=3, split="tuning")
    with pytest.raises(ValueError, match=r"split must be one of \('reported', 'tuning', 'heldout', 'heldout2', 'heldout3', 'heldout4', "
                                         r"'heldout5', 'heldout6'\), got 'train'"):
        T.niah_prose(500, seed=1000, split="train")
    with pytest.raises(ValueError, match=r"split='heldout' takes seeds from HELDOUT_SEEDS \(2000..2999\), got seed=1000"):
        T.niah_prose(500, seed=1000, split="heldout")
    with pytest.raises(ValueError, match=r"split='heldout2' takes seeds from HELDOUT2_SEEDS \(3000..3999\), got seed=2000"):
        T.niah_prose(500, seed=2000, split="heldout2")


def test_every_split_reads_one_prose_source_in_the_order_the_splits_were_made():
    """Each split of niah_prose has its text's source in `_PROSE_SOURCES`, in the order of `PROSE_POOLS` (a split's
    sentences are its source's less every earlier split's), and a split that has none is an error naming them."""
    assert [split for split, _, _ in T._PROSE_SOURCES] == list(T.PROSE_POOLS)
    with pytest.raises(ValueError, match=r"split must be one of \('reported', 'tuning', .*'heldout6'\), got 'train'"):
        T._prose_sentences("train")


@pytest.mark.parametrize("split, name, seeds", [("heldout3", "HELDOUT3_SEEDS", range(4000, 5000)),
                                                ("heldout4", "HELDOUT4_SEEDS", range(5000, 6000)),
                                                ("heldout5", "HELDOUT5_SEEDS", range(6000, 7000)),
                                                ("heldout6", "HELDOUT6_SEEDS", range(7000, 8000))])
def test_a_later_heldout_split_takes_only_its_own_seeds(split, name, seeds):
    """A seed just below or just past the split's range, or a reported one, is refused, naming the range."""
    for seed in (seeds.start - 1, seeds.stop, 0):
        with pytest.raises(ValueError, match=rf"split='{split}' takes seeds from {name} \({seeds.start}..{seeds.stop - 1}\), "
                                             rf"got seed={seed}"):
            T.niah_prose(500, seed=seed, split=split)
    assert getattr(T, name) == seeds and T.SPLIT_SEEDS[split] is getattr(T, name)


@needs_idle
@pytest.mark.parametrize("split, earlier, seeds", [
    ("heldout", ("reported", "tuning"), (2000, 2029)),
    ("heldout2", ("reported", "tuning", "heldout"), (3000, 3029)),
    ("heldout3", ("reported", "tuning", "heldout", "heldout2"), (4000, 4029)),
    ("heldout4", ("reported", "tuning", "heldout", "heldout2", "heldout3"), (5000, 5029)),
    ("heldout5", ("reported", "tuning", "heldout", "heldout2", "heldout3", "heldout4"), (6000, 6029)),
    ("heldout6", ("reported", "tuning", "heldout", "heldout2", "heldout3", "heldout4", "heldout5"), (7000, 7029)),
])
def test_a_heldout_split_shares_no_text_name_town_or_wording_with_the_splits_before_it(split, earlier, seeds):
    """split="heldout" (IDLE's user manual), "heldout2" (CPython's licence and IDLE's notes), "heldout3" (IDLE's 2.x
    news and IDLEfork's change log), "heldout4" (the email package's architecture notes, IDLE's notes on its tests and
    the email package's parsers' docstrings), "heldout5" (the docstrings of IDLE's own modules) and "heldout6" (the
    docstrings of the modules of IDLE's features): a text and pools of names, towns and fact wordings that no split before it
    uses; seeds from the split's own range; a sample is fixed by its seed."""
    heldout = set(T._prose_sentences(split))
    assert len(heldout) > 150 and not heldout & set().union(*(T._prose_sentences(e) for e in earlier))
    first_names, surnames, towns, facts = T.PROSE_POOLS[split]
    words = set(first_names) | set(surnames) | set(towns)
    assert len(words) == len(first_names) + len(surnames) + len(towns)
    for pool in (T.PROSE_POOLS[e] for e in earlier):
        assert not words & (set(pool[0]) | set(pool[1]) | set(pool[2]))
        for kind in ("names", "places"):
            assert not {part for fact in facts[kind] for part in fact} & {part for fact in pool[3][kind] for part in fact}
    for seed in seeds:
        s = T.niah_prose(900, 0.5, seed=seed, split=split)
        (needle,) = s.needles
        kind = "names" if s.question.startswith("Who") else "places"
        assert any(needle == fact.format(s.answers[0]) and s.question == question for fact, question, _ in facts[kind])
        assert set(s.answers[0].split(" ")) <= words
        assert any(s.context.replace(needle, "").strip().startswith(sentence) for sentence in heldout)
        assert s == T.niah_prose(900, 0.5, seed=seed, split=split)


@needs_idle
def test_the_second_heldout_text_is_the_licence_and_idles_notes_without_news_tags():
    from kvcompress.eval.capture import notes_paragraphs

    paragraphs = notes_paragraphs()
    assert paragraphs[0].startswith("Python was created in the early 1990s by Guido van Rossum")
    assert len(paragraphs) > 200 and not any(p.startswith(("gh-", "bpo-")) for p in paragraphs)


@needs_idle
def test_the_third_heldout_text_is_idles_old_news_and_change_log_without_bullets_files_or_tags():
    from kvcompress.eval.capture import changelog_paragraphs

    paragraphs = changelog_paragraphs()
    assert paragraphs[0].startswith("idle.py modified and simplified to better support developing experimental versions")
    assert "Add new command, \"Open module\". You select or type a module name, and it opens the source." in paragraphs
    assert len(paragraphs) > 250 and not any(re.match(r"[-+*] |(Issue|Bug|Patch) ?#?\d+:|\w+\.py: ", p) for p in paragraphs)
    assert len(set(T._prose_sentences("heldout3"))) > 400


@needs_idle
def test_the_fourth_heldout_text_is_emails_architecture_idles_test_notes_and_emails_parser_docstrings_without_markup():
    from kvcompress.eval.capture import (ARCHITECTURE_MODULES, DOCSTRING_MODULES, HELDOUT_MODULES, SCORER_TRAINING_MODULES,
                                         architecture_paragraphs)

    paragraphs = architecture_paragraphs()
    assert paragraphs[0] == ("An object structure that represents an email message, and provides an API for creating, "
                             "querying, and modifying a message.")  # a definition list's entry, without its term
    assert "The tests are being run on Linux and X Windows is not available." in paragraphs  # a list item, without its bullet
    assert "The message model is implemented by the Message class." in " ".join(paragraphs)  # a role, its target's name
    docstrings = paragraphs.index("Header value parser implementing various email-related RFC parsing rules.")  # a module's
    assert not any(re.search(r"`|:\w+:|^[-+*] ", p) for p in paragraphs[:docstrings])  # the files' markup is gone
    # the modules are in no other list of docstrings: tuning's, KVzap's training text's, its fidelity's text's
    assert not set(ARCHITECTURE_MODULES) & set(DOCSTRING_MODULES + SCORER_TRAINING_MODULES + HELDOUT_MODULES)
    sentences = T._prose_sentences("heldout4")
    assert len(sentences) > 250 and len(set(sentences)) == len(sentences)


@needs_idle
def test_the_fifth_heldout_text_is_the_docstrings_of_idles_own_modules():
    from kvcompress.eval.capture import (ARCHITECTURE_MODULES, DOCSTRING_MODULES, HELDOUT_MODULES, IDLE_SOURCE_MODULES,
                                         SCORER_TRAINING_MODULES, architecture_paragraphs, idle_source_paragraphs)

    paragraphs = idle_source_paragraphs()
    assert paragraphs[0].startswith("Customize font faces, sizes, and colorization attributes.")  # configdialog's module's
    assert "Count the number of lines in a given text." in paragraphs  # a method's (idlelib.squeezer.Squeezer.count_lines)
    assert len(paragraphs) == len(set(paragraphs)) > 200
    # the modules are in no other list of docstrings, and its text is as long as the fourth set's
    assert not set(IDLE_SOURCE_MODULES) & set(DOCSTRING_MODULES + SCORER_TRAINING_MODULES + HELDOUT_MODULES + ARCHITECTURE_MODULES)
    assert sum(map(len, paragraphs)) > sum(map(len, architecture_paragraphs()))
    sentences = T._prose_sentences("heldout5")
    assert len(sentences) > 400 and len(set(sentences)) == len(sentences)
    # every sentence of the text is the split's: no earlier split has one
    assert set(sentences) == {s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 4}


@needs_idle
def test_the_sixth_heldout_text_is_the_docstrings_of_the_modules_of_idles_features():
    from kvcompress.eval.capture import (ARCHITECTURE_MODULES, DOCSTRING_MODULES, HELDOUT_MODULES, IDLE_FEATURE_MODULES,
                                         IDLE_SOURCE_MODULES, SCORER_TRAINING_MODULES, idle_feature_paragraphs,
                                         idle_source_paragraphs)

    paragraphs = idle_feature_paragraphs()
    assert paragraphs[0] == "Define SearchDialogBase used by Search, Replace, and Grep dialogs."  # searchbase's module's
    assert "Return the new or existing singleton SearchDialog instance." in paragraphs  # a function's (idlelib.search._setup)
    assert len(paragraphs) == len(set(paragraphs)) > 200
    # the modules are in no other list of docstrings, the fifth set's and the extra text KVzap's inputs were tuned on too
    assert not set(IDLE_FEATURE_MODULES) & set(DOCSTRING_MODULES + SCORER_TRAINING_MODULES + HELDOUT_MODULES
                                               + ARCHITECTURE_MODULES + IDLE_SOURCE_MODULES + _extra_modules())
    # its text is as long as the fifth set's
    assert sum(map(len, paragraphs)) > sum(map(len, idle_source_paragraphs()))
    sentences = T._prose_sentences("heldout6")
    assert len(sentences) > 400 and len(set(sentences)) == len(sentences)
    assert sum(map(len, sentences)) > sum(map(len, T._prose_sentences("heldout5")))
    # every sentence of the text is the split's: no earlier split has one
    assert set(sentences) == {s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 4}


@needs_idle
@pytest.mark.parametrize("split", ["heldout3", "heldout4", "heldout5", "heldout6"])
def test_a_later_heldout_text_is_neither_kvzaps_text_nor_holds_an_answer_of_its_split(split):
    """No sentence of the split's text is in KVzap's training text (`kvcompress train-scorer`), the text its fidelity is
    reported on, or the extra text its inputs were tuned on (benchmarks/tuning/scorer_inputs.py); no answer of the split
    is a word of its text."""
    from kvcompress.eval.capture import HELDOUT_MODULES, SCORER_TRAINING_MODULES, docstring_paragraphs

    sentences = set(T._prose_sentences(split))
    extra = _extra_modules()
    assert len(extra) > 100
    for modules in (SCORER_TRAINING_MODULES, HELDOUT_MODULES, extra):
        assert not sentences & {s for p in docstring_paragraphs(modules) for s in re.split(r"(?<=[.!?])\s+", p)}
    first_names, surnames, towns, _ = T.PROSE_POOLS[split]
    text = " ".join(sentences)
    assert not [w for w in first_names + surnames + towns if re.search(rf"\b{w}\b", text, re.IGNORECASE)]


def _haystack_sentences(sample):
    (needle,) = sample.needles
    before, after = sample.context.split(needle)
    return [s for part in (before, after) for s in re.split(r"(?<=[.!?])\s+", part.strip()) if s]


@needs_idle
@pytest.mark.parametrize("split, seeds", [("heldout2", (3000, 3001, 3517)), ("heldout3", (4000, 4001, 4517)),
                                          ("heldout4", (5000, 5001, 5517)), ("heldout5", (6000, 6001, 6517)),
                                          ("heldout6", (7000, 7001, 7517))])
@pytest.mark.parametrize("length", [2048, 4096])
def test_a_heldout_split_fills_2048_and_4096_tokens_without_cycling_its_text(split, seeds, length):
    """At 2048 and 4096 (estimated) tokens a sample's haystack is its split's sentences, no more of them than the text
    holds: the text is not read round twice."""
    sentences = T._prose_sentences(split)
    for seed in seeds:
        s = T.niah_prose(length, 0.5, seed=seed, split=split)
        assert length - 60 <= s.n_tokens <= length
        haystack = _haystack_sentences(s)
        assert set(haystack) <= set(sentences) and len(haystack) <= len(sentences)


@needs_idle
@pytest.mark.e2e
@pytest.mark.parametrize("split, seeds", [("heldout3", (4000, 4001, 4517)), ("heldout4", (5000, 5001, 5517)),
                                          ("heldout5", (6000, 6001, 6517)), ("heldout6", (7000, 7001, 7517))])
def test_the_later_heldout_splits_fill_4096_tokens_of_the_default_models_tokenizer_without_repeating(default_model, split, seeds):
    """With the default model's tokenizer, 2048 and 4096 tokens of split "heldout3", "heldout4", "heldout5" or "heldout6"
    hold no sentence twice (samples are built and counted, never run)."""
    _, tokenizer = default_model
    sentences = T._prose_sentences(split)
    assert len(set(sentences)) == len(sentences)
    for length in (2048, 4096):
        for seed in seeds:
            s = T.niah_prose(length, 0.5, seed=seed, tokenizer=tokenizer, split=split)
            assert length - 60 <= s.n_tokens <= length
            haystack = _haystack_sentences(s)
            assert set(haystack) <= set(sentences) and len(set(haystack)) == len(haystack)


@needs_idle
@pytest.mark.e2e
@pytest.mark.parametrize("length", [2048, 4096])
def test_the_fourth_heldout_split_still_builds_the_samples_its_records_hold(default_model, length):
    """The fourth held-out set's committed samples (results/heldout4_{2048,4096}) are what the split builds now, with the
    default model's tokenizer: the same needle, question and measured depth, and a context whose text the recorded prompt
    holds (the text did not change when the fifth set's reading was factored out of it)."""
    _, tokenizer = default_model
    with gzip.open(ROOT / "results" / f"heldout4_{length}" / "samples.jsonl.gz", "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["seed"] for r in records] == list(range(5000, 5030))
    for r in records[::7]:
        s = T.niah_prose(length, r["depth"], seed=r["seed"], tokenizer=tokenizer, split="heldout4")
        assert (s.needles, s.question, s.answers, s.depths) == (r["needles"], r["question"], r["answers"], [r["measured_depth"]])
        assert s.context in tokenizer.decode(r["context_ids"])
