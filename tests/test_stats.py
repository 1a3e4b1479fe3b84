"""colora.studies.stats against hand-computed values and scipy on fixed data."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from colora.studies import stats
from colora.studies.stats import FAIL, NOT_EVALUATED, PASS, Gates, Interval


def test_average_repeats_then_pair_by_job_and_seed():
    arm = {("a", 1, 0): 0.5, ("a", 1, 1): 0.7, ("b", 1, 0): 0.2}
    base = {("a", 1, 0): 0.4, ("b", 1, 0): 0.1, ("b", 1, 1): 0.3}
    a, b = stats.average_repeats(arm), stats.average_repeats(base)
    assert a == pytest.approx({("a", 1): 0.6, ("b", 1): 0.2})
    assert b == pytest.approx({("a", 1): 0.4, ("b", 1): 0.2})
    assert stats.paired_differences(a, b) == pytest.approx([0.2, 0.0])  # sorted keys: a, b


def test_unpaired_keys_are_named():
    both = r"in the arm but not the baseline: \('c', 2\).*in the baseline but not the arm: \('d', 1\)"
    with pytest.raises(ValueError, match=both):
        stats.paired_differences({("a", 1): 1.0, ("c", 2): 1.0}, {("a", 1): 1.0, ("d", 1): 1.0})
    with pytest.raises(ValueError, match="repeat index"):
        stats.average_repeats({"a": 1.0})


def test_t_interval_by_hand():
    x = [0.1, 0.3, 0.2, 0.4]  # mean 0.25, sd sqrt(0.05/3), n 4
    iv = stats.t_interval(x)
    half = 3.182446305284263 * math.sqrt(0.05 / 3) / 2  # t_{0.975, 3} from tables
    assert iv.mean == pytest.approx(0.25)
    assert (iv.low, iv.high) == pytest.approx((0.25 - half, 0.25 + half))
    assert iv.n == 4 and iv.method == "t"


@pytest.mark.parametrize("conf", [0.9, 0.95, 0.99])
def test_t_interval_matches_scipy(conf):
    x = np.array([0.03, -0.01, 0.07, 0.02, 0.05, -0.04, 0.06, 0.0])
    lo, hi = sps.t.interval(conf, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    iv = stats.t_interval(x, conf)
    assert (iv.low, iv.high) == pytest.approx((lo, hi))
    # and the one-sample t-test agrees: 0 is outside the interval exactly when p < 1 - conf
    p = sps.ttest_1samp(x, 0.0).pvalue
    assert (iv.low > 0 or iv.high < 0) == (p < 1 - conf)


def test_t_interval_degenerate_cases():
    assert stats.t_interval([0.1, 0.1, 0.1]).low == pytest.approx(0.1)
    one = stats.t_interval([0.3])
    assert one.mean == 0.3 and math.isnan(one.low) and not one.defined()
    with pytest.raises(ValueError, match="non-finite"):
        stats.t_interval([0.1, float("nan")])
    with pytest.raises(ValueError, match="conf"):
        stats.t_interval([0.1, 0.2], conf=95)


def _numpy_percentile_bootstrap(x, rng, n, conf):
    idx = rng.integers(0, len(x), size=(n, len(x)))
    means = x[idx].mean(axis=1)
    return np.percentile(means, [100 * (1 - conf) / 2, 100 * (1 + conf) / 2])


def test_bootstrap_interval_is_scipys_and_reproducible():
    x = np.array([0.125, 0.0, -0.25, 0.0625, 0.0, 0.1875, -0.0625, 0.125])
    a = stats.bootstrap_interval(x, np.random.default_rng(7), n_resamples=5000)
    b = stats.bootstrap_interval(x, np.random.default_rng(7), n_resamples=5000)
    assert a == b  # the same generator state gives the same interval
    ref = sps.bootstrap((x,), np.mean, n_resamples=5000, method="percentile",
                        **{stats._BOOTSTRAP_RNG_KW: np.random.default_rng(7)})
    assert (a.low, a.high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high))
    # and agrees with a plain numpy percentile bootstrap to Monte-Carlo precision
    lo, hi = _numpy_percentile_bootstrap(x, np.random.default_rng(1), 20000, 0.95)
    assert (a.low, a.high) == pytest.approx((lo, hi), abs=0.012)
    assert a.method == "bootstrap-percentile" and a.low < x.mean() < a.high


def test_bootstrap_bca_and_degenerate():
    x = np.array([0.3, 0.1, 0.9, 0.2, 0.15, 0.25, 0.1])
    bca = stats.bootstrap_interval(x, np.random.default_rng(0), 4000, method="BCa")
    ref = sps.bootstrap((x,), np.mean, n_resamples=4000, method="BCa",
                        **{stats._BOOTSTRAP_RNG_KW: np.random.default_rng(0)})
    assert (bca.low, bca.high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high))
    same = stats.bootstrap_interval([0.05] * 4, np.random.default_rng(0))
    assert (same.low, same.high) == (0.05, 0.05)
    assert not stats.bootstrap_interval([0.05], np.random.default_rng(0)).defined()
    with pytest.raises(TypeError, match="Generator"):
        stats.bootstrap_interval(x, 0)
    with pytest.raises(ValueError, match="method"):
        stats.bootstrap_interval(x, np.random.default_rng(0), method="basic")


def test_aa_spread_and_ratios():
    assert stats.aa_spread(1504.1, 1532.7) == pytest.approx(28.6 / 1504.1)
    assert stats.aa_spread(100.0, 92.4) == pytest.approx(-0.076)
    with pytest.raises(ValueError, match="positive"):
        stats.aa_spread(0.0, 1.0)
    # the reference study's numbers: 3119.2 / 1504.1 = 2.074 on seed 1
    r = stats.throughput_ratios({1: 3119.2, 2: 2786.3, 3: 3123.8}, {1: 1504.1, 2: 1273.8, 3: 1453.3})
    assert r == pytest.approx({1: 2.0738, 2: 2.1874, 3: 2.1494}, abs=5e-4)
    with pytest.raises(ValueError, match="unpaired"):
        stats.throughput_ratios({1: 1.0}, {2: 1.0})


def _iv(mean, low, high, n=24):
    return Interval(mean, low, high, n, 0.95, "t")


def test_gates_on_the_reference_numbers():
    ratios = {1: 2.074, 2: 2.187, 3: 2.149}
    res = {g.name: g for g in stats.evaluate_gates(ratios, {1: 0.019}, _iv(0.035, 0.012, 0.056),
                                                   _iv(0.016, -0.018, 0.056), Gates(), expected_seeds=[1, 2, 3])}
    assert [res[k].status for k in ("throughput", "gain_vs_aa", "eval_accuracy", "train_reward")] == [PASS] * 4
    assert res["throughput"].value == pytest.approx(2.074)
    assert res["gain_vs_aa"].value == pytest.approx((2.074 + 2.187 + 2.149) / 3 - 1)
    assert res["gain_vs_aa"].threshold == pytest.approx(5 * 0.019)
    assert "seed 1: 2.074" in res["throughput"].detail
    assert stats.overall(list(res.values())) == PASS


def test_gates_fail_and_not_evaluated():
    # the pre-registered overlap arm: 1.571x on seed 1 misses 2.0
    res = stats.evaluate_gates({1: 1.571, 2: 1.720, 3: 1.628}, {}, _iv(0.0, -0.06, 0.06), None, Gates())
    by = {g.name: g for g in res}
    assert by["throughput"].status == FAIL and by["throughput"].value == pytest.approx(1.571)
    assert by["gain_vs_aa"].status == NOT_EVALUATED and "A/A" in by["gain_vs_aa"].detail
    assert by["eval_accuracy"].status == FAIL  # -0.06 < -0.05
    assert by["train_reward"].status == NOT_EVALUATED
    assert stats.overall(res) == FAIL
    # a gain within 5 x a large A/A spread fails even above 2.0x
    g = stats.evaluate_gates({1: 2.1}, {1: -0.25}, None, None, Gates())[1]
    assert g.status == FAIL and g.threshold == pytest.approx(1.25)
    # a missing pre-registered seed makes "on every seed" unevaluable, never a pass
    g = stats.evaluate_gates({1: 2.5}, {}, None, None, Gates(), expected_seeds=[1, 2])[0]
    assert g.status == NOT_EVALUATED and "[2]" in g.detail
    # an undefined interval (one pair) is not evaluated
    g = stats.evaluate_gates({}, {}, stats.t_interval([0.1]), None, Gates())[2]
    assert g.status == NOT_EVALUATED
    mixed = [stats.GateResult("x", PASS, 1, 1, ""), stats.GateResult("y", NOT_EVALUATED, None, 1, "")]
    assert stats.overall(mixed) == NOT_EVALUATED
    with pytest.raises(ValueError, match="interval"):
        Gates(interval="z")


def test_gate_thresholds_are_inclusive_where_the_reference_says_at_least():
    res = stats.evaluate_gates({1: 2.0}, {}, _iv(0.0, -0.05, 0.05), None, Gates())
    assert res[0].status == PASS and res[2].status == PASS
