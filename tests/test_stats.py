"""Sweep statistics: Wilson intervals, the exact sign test, paired comparisons on the same samples; stop tokens."""

import pytest
from scipy.stats import binomtest

from kvcompress.eval.stats import paired_comparisons, sign_test, wilson
from kvcompress.eval.stopping import stop_token_ids
from kvcompress.eval.tasks import generate_sample


@pytest.mark.parametrize("k, n", [(0, 30), (7, 30), (30, 30), (1, 1), (12, 40)])
def test_wilson_matches_scipy(k, n):
    ref = binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((ref.low, ref.high), abs=1e-9)


def test_wilson_rejects_bad_counts_and_is_nan_for_no_samples():
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 4)
    low, high = wilson(0, 0)
    assert low != low and high != high


def test_sign_test_is_mcnemars_exact_test():
    assert sign_test(0, 0) == 1.0
    assert sign_test(9, 1) == pytest.approx(binomtest(9, 10, 0.5).pvalue)
    assert sign_test(0, 6) == pytest.approx(2 * 0.5**6)


def _rec(method, index, score, ratio=0.9, task="niah_single"):
    return {"grid": False, "method": method, "ratio": ratio, "mode": "prefill", "task": task, "length": 2048,
            "index": index, "depth": 0.5, "error": None, "score": score}


def test_paired_comparison_uses_the_best_baseline_and_only_shared_samples():
    records = [_rec("a", i, float(i < 6)) for i in range(10)] + [_rec("b", i, float(i < 3)) for i in range(10)]
    records += [_rec("hybrid", i, float(i < 9)) for i in range(9)]  # sample 9 missing: 9 pairs
    records += [_rec("a", 0, 0.0, ratio=0.5), _rec("b", 0, 1.0, ratio=0.5)]
    rows = {(r["ratio"], r["method"]): r for r in paired_comparisons(records, ["a", "b"])}
    h = rows[(0.9, "hybrid")]
    assert (h["baseline"], h["n_pairs"], h["wins"], h["losses"]) == ("a", 9, 3, 0)
    assert h["p"] == pytest.approx(0.25)
    assert (rows[(0.9, "b")]["wins"], rows[(0.9, "b")]["losses"]) == (0, 3)
    assert rows[(0.5, "a")]["baseline"] == "b" and (0.5, "b") not in rows



def test_paired_comparisons_refuse_records_of_one_sample_from_two_prompts():
    """Records of one sample pair only when they answered the same prompt (`prompt_sha256`): the prose tasks' text is the
    running Python's standard library's, so two runs can hold one sample key over two texts. Records without the
    field (those of earlier versions) are paired as before."""
    records = [_rec("a", i, 1.0) | {"prompt_sha256": f"{i}" * 64} for i in range(3)]
    records += [_rec("b", i, 0.0) | {"prompt_sha256": f"{i}" * 64} for i in range(3)]
    assert [(r["wins"], r["losses"]) for r in paired_comparisons(records, ["a"])] == [(0, 3)]
    other = records[:5] + [records[5] | {"prompt_sha256": "f" * 64}]
    with pytest.raises(ValueError, match=r"the records of sample \{'task': 'niah_single', 'length': 2048, 'index': 2, 'depth': 0.5\} "
                                         r"answered two prompts \(prompt_sha256 222222222222\.\.\. and ffffffffffff\.\.\.; method 'b'"):
        paired_comparisons(other, ["a"])
    unrecorded = records[:5] + [{k: v for k, v in records[5].items() if k != "prompt_sha256"}]
    assert [(r["wins"], r["losses"]) for r in paired_comparisons(unrecorded, ["a"])] == [(0, 3)]

class _Vocab:
    pieces = ["12", ".", "a", ">\n", "x>", "\n"]

    def __len__(self):
        return len(self.pieces)

    def batch_decode(self, ids):
        return [self.pieces[i[0]] for i in ids]


def test_stop_token_ids_are_the_tokens_containing_a_stop_string():
    tok = _Vocab()
    assert stop_token_ids(tok, (">", "\n")) == {3, 4, 5}
    assert stop_token_ids(tok, (".",)) == {1}
    assert stop_token_ids(tok, ()) == frozenset()


def test_tasks_carry_answer_limits_stop_strings_and_a_needle_answer_prefix():
    needle = generate_sample("niah_single", target_tokens=200, seed=1)
    assert needle.answer_prefix.startswith("The special magic number for") and needle.answer_prefix.endswith(" is")
    assert needle.max_new_tokens == 14 and "." in needle.stop
    values = generate_sample("niah_multivalue", target_tokens=200, seed=1, kind="uuids", n_values=3)
    assert values.answer_prefix.endswith(" are") and values.max_new_tokens == 3 * 40 + 4
    line = generate_sample("line_retrieval", target_tokens=200, seed=1, n_lines=1)
    assert line.max_new_tokens == 8 and ">" in line.stop
    assert generate_sample("common_words", target_tokens=1500, seed=1).stop == ()


def test_best_baseline_ties_go_to_the_method_with_more_samples():
    records = [_rec("a", 0, 1.0)] + [_rec("b", i, 1.0) for i in range(5)] + [_rec("c", i, 0.0) for i in range(5)]
    rows = paired_comparisons(records, ["a", "b", "c"])
    assert {r["baseline"] for r in rows} == {"b"}


@pytest.mark.parametrize("n", range(1, 60))
def test_wilson_interval_contains_the_proportion_at_zero_and_full_score(n):
    """All-correct cells (e.g. n = 3, 20) once gave a high end of 1 - 1e-16 < the mean, and a negative plot error bar."""
    low, high = wilson(n, n)
    assert low <= 1.0 == high
    low, high = wilson(0, n)
    assert low == 0.0 <= high


def test_bad_counts_and_quantiles_are_refused_by_name():
    """sign_test(-1, 3) and (1.5, 3) raised scipy's errors naming no parameter; wilson(3, "10") a TypeError; z=-1 gave an
    interval of width zero."""
    for args, message in [((-1, 3), r"wins must be an integer >= 0, got -1"), ((1.5, 3), r"wins must be an integer >= 0, got 1\.5"),
                          ((3, True), r"losses must be an integer >= 0, got True")]:
        with pytest.raises(ValueError, match=message):
            sign_test(*args)
    with pytest.raises(ValueError, match=r"n must be an integer >= 0, got '10'"):
        wilson(3, "10")
    with pytest.raises(ValueError, match=r"successes must be a finite number \(the sum of the scores\), got nan"):
        wilson(float("nan"), 10)
    for z in (-1, 0, float("inf")):
        with pytest.raises(ValueError, match=r"z must be .*\(the normal quantile of the confidence, 1\.96 for 95%\), got"):
            wilson(3, 10, z=z)
    low, high = wilson(2.5, 10)  # fractional successes: the sum of multi-answer scores
    assert low < 0.25 < high


def test_paired_comparisons_refuse_records_without_their_fields_and_a_bare_baseline_name():
    """A record without 'ratio' raised KeyError: 'ratio'; baselines="full_cache" was tested as a substring ("a" in it)."""
    records = [_rec("a", i, 1.0) for i in range(3)] + [_rec("b", i, 0.0) for i in range(3)]
    broken = [r.copy() for r in records]
    del broken[4]["ratio"]
    with pytest.raises(ValueError, match=r"records\[4\] lacks \['ratio'\]: a scored record needs \['method', 'ratio', 'mode', 'task', "):
        paired_comparisons(broken, ["a"])
    with pytest.raises(ValueError, match=r"baselines must be a list of method names, got the string 'ab': pass \['ab'\] for one"):
        paired_comparisons(records, "ab")
    assert [r["baseline"] for r in paired_comparisons(records, ["a"])] == ["a"]
    assert paired_comparisons([_rec("a", 0, None), {"grid": True, "score": 1.0}], ["a"]) == []  # unscored and grid records need nothing
