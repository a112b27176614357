"""How a loader setting fits the model's need: a value the stage branches on, with the text it writes."""

from __future__ import annotations

import pytest

from saturate.tune.loader_stage import Fit, Fitted, Need, fit, ladder
from saturate.tune.trial import LoaderTrial


def trial(rate: float | None, spread: float | None = 0.05) -> LoaderTrial:
    return LoaderTrial(num_workers=2, prefetch_factor=2, pin_memory=False, samples_per_s=rate, spread=spread)


@pytest.mark.parametrize(("rate", "spread", "expected"), [
    (900.0, 0.05, Fitted(Fit.FEEDS)),  # +50 % against ±10 %: beyond both spreads, nothing to say
    (640.0, 0.10, Fitted(Fit.WITHIN_NOISE, "640.0 ±10.0 % samples/s vs 600 needed: within noise (±15.0 %)")),
    (300.0, 0.05, Fitted(Fit.TOO_SLOW, "300.0 ±5.0 % samples/s vs 600 needed: too slow")),
    (None, None, Fitted(Fit.NOT_MEASURED, "not measured")),
])
def test_each_fit_is_reached_with_its_text(rate, spread, expected):
    assert fit(trial(rate, spread), Need(600.0, 0.05)) == expected


def test_a_setting_feeds_only_beyond_the_noise_and_only_then_says_nothing():
    need = Need(600.0, 0.05)
    assert fit(trial(600.0 * 1.11), need).fit is Fit.FEEDS  # +11 % against ±10 %
    assert fit(trial(600.0 * 1.09), need).fit is Fit.WITHIN_NOISE  # passes the need, not its noise
    assert all(fit(trial(r), need).text == "" for r in (700.0, 1000.0))
    assert all(fit(trial(r), need).text for r in (500.0, 600.0, 100.0))  # every shortfall is explained


def test_nothing_needed_is_fed_by_any_measured_rate():
    assert fit(trial(1.0), Need(0.0, None)) == Fitted(Fit.FEEDS)


def test_the_worker_ladder():
    assert ladder(2) == [0, 1, 2] and ladder(6) == [0, 1, 2, 4, 6]
