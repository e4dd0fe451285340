"""Goodput benchmark metrics on constructed timelines: every figure is known in advance."""
import math

import pytest

from nxdi_bench.metrics import SLO, RequestRecord, find_goodput, percentiles, summarize


def record(i, due, times, end=None, n_out=None, error=None, prompt=10):
    return RequestRecord(index=i, kind="chat", due_s=due, prompt_tokens=prompt,
                         expected_output_tokens=len(times), sent_s=due, token_times=list(times),
                         end_s=end if end is not None else (times[-1] if times else due),
                         output_tokens=n_out, error=error)


def test_request_latencies_from_a_timeline():
    r = record(0, due=1.0, times=[1.5, 1.6, 1.8, 2.1], end=2.15, n_out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx(0.6 / 3)
    assert r.e2e == pytest.approx(1.15)


def test_tpot_uses_the_servers_token_count_when_events_carry_several_tokens():
    # 3 events but the usage said 7 tokens: TPOT spreads the time over 6 gaps, not 2.
    r = record(0, due=0.0, times=[1.0, 1.3, 1.6], n_out=7)
    assert r.tpot == pytest.approx(0.6 / 6)


def test_one_token_output_has_no_tpot_and_meets_any_tpot_slo():
    r = record(0, due=0.0, times=[0.4], n_out=1)
    assert r.tpot is None
    assert SLO(0.5, 0.001).met_by(r)
    assert not SLO(0.3, 1.0).met_by(r)


def test_failed_request_has_no_latencies_and_misses_the_slo():
    r = record(0, due=0.0, times=[], error="HTTP 429: busy")
    assert not r.ok and r.ttft is None and r.tpot is None and r.itls == []
    assert not SLO(100, 100).met_by(r)


def test_ttft_is_measured_from_the_due_time_not_the_send_time():
    r = record(0, due=2.0, times=[3.0, 3.1])
    r.sent_s = 2.9  # the client fell behind by 0.9 s: that is queueing the user saw
    assert r.ttft == pytest.approx(1.0)


def test_percentiles_interpolate_linearly():
    p = percentiles([0.1 * k for k in range(1, 11)] + [None])
    assert p.count == 10
    assert p.p50 == pytest.approx(0.55)
    assert p.p90 == pytest.approx(0.91)      # rank 0.9 * 9 = 8.1 -> 0.9 + 0.1 * 0.1
    assert p.p99 == pytest.approx(0.991)
    assert p.mean == pytest.approx(0.55) and p.max == pytest.approx(1.0)
    assert percentiles([]).p50 is None


def test_run_summary_throughput_attainment_and_goodput_rate():
    # 10 requests due every second; request k has TTFT 0.1*(k+1) and 5 tokens 0.05 s apart,
    # except request 9 whose tokens are 0.3 s apart; request 4 failed.
    recs = []
    for k in range(10):
        due = float(k)
        gap = 0.3 if k == 9 else 0.05
        first = due + 0.1 * (k + 1)
        times = [first + gap * j for j in range(5)]
        recs.append(record(k, due, times, end=times[-1], n_out=5,
                           error="boom" if k == 4 else None))
    s = summarize(recs, SLO(ttft_s=0.75, tpot_s=0.1), rate=1.0)
    # meets: TTFT <= 0.75 -> k = 0..6 (0.7 for k=6), minus failed k=4 -> 6 of 10
    assert s.slo_attainment == pytest.approx(0.6)
    assert (s.completed, s.failed) == (9, 1)
    end = 9 + 1.0 + 0.3 * 4                  # the last request's last token
    assert s.duration_s == pytest.approx(end)
    assert s.request_throughput == pytest.approx(9 / end)
    assert s.output_token_throughput == pytest.approx(45 / end)
    assert s.input_token_throughput == pytest.approx(90 / end)
    assert s.good_request_rate == pytest.approx(6 / end)
    assert s.ttft_s.count == 9 and s.ttft_s.max == pytest.approx(1.0)
    assert s.tpot_s.max == pytest.approx(0.3)
    assert s.itl_s.count == 9 * 4
    assert s.errors == ["boom"]


def _measure_with_knee(knee):
    """A fake server that meets the SLO for every request below ``knee`` req/s, half above."""
    calls = []

    def measure(rate):
        calls.append(rate)
        ok = rate <= knee
        recs = [record(i, float(i), [i + (0.1 if ok or i % 2 else 5.0)], n_out=1)
                for i in range(10)]
        return summarize(recs, SLO(1.0, 1.0), rate=rate)
    return measure, calls


def test_goodput_doubles_then_bisects():
    measure, calls = _measure_with_knee(3.3)
    result = find_goodput(measure, SLO(1.0, 1.0), start_rate=0.5, bisect_steps=3)
    assert calls == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5, 3.25]
    assert result.goodput == pytest.approx(3.25)
    assert [p.passed for p in result.points] == [True, True, True, False, True, False, True]


def test_goodput_halves_when_the_start_rate_already_fails():
    measure, calls = _measure_with_knee(0.2)
    result = find_goodput(measure, SLO(1.0, 1.0), start_rate=1.0, bisect_steps=1)
    assert calls == [1.0, 0.5, 0.25, 0.125, 0.1875]
    assert result.goodput == pytest.approx(0.1875)


def test_goodput_is_zero_when_nothing_passes():
    measure, calls = _measure_with_knee(0.0)
    result = find_goodput(measure, SLO(1.0, 1.0), start_rate=1.0, min_rate=0.25)
    assert calls == [1.0, 0.5, 0.25]
    assert result.goodput == 0.0


def test_goodput_stops_at_the_max_rate():
    measure, calls = _measure_with_knee(math.inf)
    result = find_goodput(measure, SLO(1.0, 1.0), start_rate=1.0, max_rate=8.0)
    assert calls == [1.0, 2.0, 4.0, 8.0] and result.goodput == 8.0
    assert result.to_dict()["points"][0]["summary"]["slo_attainment"] == 1.0


@pytest.mark.parametrize("kwargs, field", [
    (dict(ttft_s=0, tpot_s=1), "ttft_s"), (dict(ttft_s=1, tpot_s=1, attainment=1.5), "attainment")])
def test_bad_slo_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SLO(**kwargs)
