"""cached_throughput (measure once, cache on disk) and time_per_call (median wall time)."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import pytest

import swarm.measure as measure
from swarm.measure import cached_throughput, time_per_call


class Measure:
    def __init__(self, value: float) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.value


def cache_file(cache_dir):
    return cache_dir / "throughput.json"


def test_measures_once_then_reads_cache(tmp_path):
    first = Measure(123.5)
    assert cached_throughput(tmp_path, "llama-h64-cpu", first) == 123.5
    assert first.calls == 1
    assert json.loads(cache_file(tmp_path).read_text()) == {"llama-h64-cpu": 123.5}
    second = Measure(999.0)
    for _ in range(3):
        assert cached_throughput(tmp_path, "llama-h64-cpu", second) == 123.5
    assert second.calls == 0
    assert [p.name for p in tmp_path.iterdir()] == ["throughput.json"]  # no temporary file left behind


def test_creates_missing_cache_dir(tmp_path):
    cache_dir = tmp_path / "a" / "b"
    assert cached_throughput(cache_dir, "k", Measure(7)) == 7.0
    assert json.loads(cache_file(cache_dir).read_text()) == {"k": 7.0}


def test_keys_are_separate(tmp_path):
    values = {"gpt2-cpu-float32": 10.0, "llama-cpu-float32": 20.0, "llama-cpu-bfloat16": 30.0}
    for key, value in values.items():
        m = Measure(value)
        assert cached_throughput(tmp_path, key, m) == value and m.calls == 1
    assert json.loads(cache_file(tmp_path).read_text()) == values
    for key, value in values.items():
        m = Measure(-1.0)
        assert cached_throughput(tmp_path, key, m) == value and m.calls == 0


@pytest.mark.parametrize(
    "content, warns, kept",
    [
        ("not json {", True, {}),
        ("", True, {}),
        ("[1, 2, 3]", True, {}),
        ('"a string"', True, {}),
        ("null", True, {}),
        ('{"k": -5}', False, {}),  # an invalid value is measured again
        ('{"k": 0}', False, {}),
        ('{"k": "fast"}', False, {}),
        ('{"k": null}', False, {}),
        ('{"other": 7.5}', False, {"other": 7.5}),  # other keys survive
    ],
)
def test_bad_cache_is_measured_and_rewritten(tmp_path, caplog, content, warns, kept):
    cache_file(tmp_path).write_text(content)
    m = Measure(42.0)
    with caplog.at_level(logging.WARNING, logger="swarm.measure"):
        assert cached_throughput(tmp_path, "k", m) == 42.0
    assert m.calls == 1
    assert json.loads(cache_file(tmp_path).read_text()) == {**kept, "k": 42.0}
    assert ("unreadable throughput cache" in caplog.text) == warns
    again = Measure(1.0)
    assert cached_throughput(tmp_path, "k", again) == 42.0 and again.calls == 0


def test_unreadable_cache_path(tmp_path, caplog):
    """A directory where the file should be: warned about, and the error of rewriting it surfaces."""
    cache_file(tmp_path).mkdir()
    with caplog.at_level(logging.WARNING, logger="swarm.measure"), pytest.raises(OSError):
        cached_throughput(tmp_path, "k", Measure(1.0))
    assert "unreadable throughput cache" in caplog.text


class FakeClock:
    """perf_counter that advances only when the timed function says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "durations, warmup, repeats, median",
    [
        ([5.0, 1.0, 3.0, 2.0, 4.0], 0, 5, 3.0),
        ([100.0, 5.0, 1.0, 3.0, 2.0, 4.0], 1, 5, 3.0),  # the warmup call is not timed
        ([9.0, 9.0, 1.0, 100.0, 1.0], 2, 3, 1.0),
        ([0.5], 0, 1, 0.5),
        ([1.0, 2.0], 0, 2, 2.0),  # upper median of an even count
        ([0.0, 0.0, 0.25, 0.75, 0.5], 2, 3, 0.5),
    ],
)
def test_time_per_call_median(monkeypatch, durations, warmup, repeats, median):
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    calls = iter(durations)

    def fn():
        clock.now += next(calls)

    assert time_per_call(fn, warmup=warmup, repeats=repeats) == pytest.approx(median)
    assert next(calls, None) is None  # called exactly warmup + repeats times


def test_time_per_call_real_clock():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    seconds = time_per_call(fn)
    assert len(calls) == 6  # 1 warmup + 5 repeats
    assert 0.0015 < seconds < 0.5


@pytest.mark.parametrize(
    "content",
    [None, "{}", '{"compute:k": {"forward": -1, "backward": 2}}', '{"compute:k": 5}', '{"compute:k": {"forward": 1}}',
     '{"compute:k": {"forward": "1", "backward": 2}}', '{"compute:k": {"forward": NaN, "backward": 2}}'],
)
def test_cached_compute_measures_once(tmp_path, content):
    """Absent or invalid: measured and written; then read back without measuring, beside the throughput."""
    if content is not None:
        cache_file(tmp_path).write_text(content)
    calls = []

    def measure_it() -> measure.Compute:
        calls.append(1)
        return measure.Compute(1e-4, 3e-4)

    assert measure.cached_compute(tmp_path, "k", measure_it) == measure.Compute(1e-4, 3e-4)
    assert measure.cached_compute(tmp_path, "k", measure_it) == measure.Compute(1e-4, 3e-4)
    assert len(calls) == 1
    assert cached_throughput(tmp_path, "t", Measure(5.0)) == 5.0  # one file for both
    assert json.loads(cache_file(tmp_path).read_text())["compute:k"] == {"forward": 1e-4, "backward": 3e-4}


@pytest.mark.parametrize("forward, backward", [(0.0, 1.0), (1.0, -1.0), (float("nan"), 1.0), (1.0, float("inf"))])
def test_compute_must_be_positive(forward, backward):
    with pytest.raises(ValueError, match="compute must be a positive number"):
        measure.Compute(forward, backward)
