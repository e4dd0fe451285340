"""bench/gap_causes.py on a constructed run: a decode worker's step lines (--log-steps), the
router's request line and a client's token times on its own clock. Each gap over the threshold
gets the cause built into it: a paced pause before the step, a slow step, or a token delivered
late after steps on time; the client's clock is found from the router's line and the steps."""
from __future__ import annotations

import datetime
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = datetime.datetime(2026, 12, 6, 12, 0, 0, tzinfo=datetime.timezone.utc).timestamp()


def load_module():
    spec = importlib.util.spec_from_file_location("gap_causes", ROOT / "bench" / "gap_causes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def constructed_run(folder: Path) -> None:
    """40 steps 15 ms apart from BASE + 1 s, but step 10 after a 10 ms paced pause and step 20
    a 25 ms step (each 25 ms after the one before); one stream with a token 0.5 ms after every
    step end, except the one of step 30, 8 ms late; the client's clock starts at BASE + 0.7 s."""
    ends, t = [], BASE + 1.0
    lines = []
    for i in range(40):
        seconds, paused = (0.025, 0.0) if i == 20 else (0.015, 0.010 if i == 10 else 0.0)
        t += 0.025 if i in (10, 20) else 0.015
        ends.append(t)
        lines.append(f"[decode0] 2026-12-06 12:00:01,000 decode INFO decode_service.steps: step "
                     f"end={t:.6f} seconds={seconds:.6f} rows=1 calls=1 paused={paused:.6f} "
                     f"local={1 if paused else 0}")
    t0 = BASE + 0.7
    tokens = [e + 0.0005 + (0.008 if i == 30 else 0.0) - t0 for i, e in enumerate(ends)]
    last = datetime.datetime.fromtimestamp(tokens[-1] + t0 + 0.0004, datetime.timezone.utc)
    lines.append(f"[router] {last:%Y-%m-%d %H:%M:%S},{last.microsecond // 1000:03d} INFO router "
                 f"router.requests: request abc ok decode=127.0.0.1:1 prefill=local prompt=50 "
                 f"cached=0 output=40 finish=length ttft=0.300s e2e=1.000s")
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "disaggregated.log").write_text("\n".join(lines) + "\n")
    records = [{"index": 0, "kind": "chat", "prompt_tokens": 50, "output_tokens": 40,
                "due_s": 0.0, "sent_s": 0.0, "token_times": tokens}]
    (folder / "records.json").write_text(json.dumps({"disaggregated": records}))


def test_each_long_gap_gets_the_cause_built_into_it(tmp_path, capsys):
    gap_causes = load_module()
    constructed_run(tmp_path)
    records, steps, router_ends = gap_causes.load(tmp_path)
    offset = gap_causes.clock_offset(records, [s[0] for s in steps], router_ends)
    assert abs(offset - (BASE + 0.6995)) < 0.0002  # tokens onto their steps: start less 0.5 ms
    total, found = gap_causes.long_gaps(records, steps, offset, 0.0213)
    assert total == 39
    assert [(round(gap, 4), cause) for _, gap, _, _, _, _, _, cause in found] == [
        (0.025, "paced"), (0.025, "slow step"), (0.023, "delivery")]
    assert gap_causes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "39 gaps, 3 over 21.3 ms (7.69%): " in out and "steps of 1 rows: 40" in out
    assert "steps of 1-2 rows over 17.0 ms: 1 of 40" in out
    # the 8 ms late token is the one over 2 ms past the median (0.5 ms) of 39, all of steps
    # while nobody waited for a first token (the request's own wait ended before step 0)
    assert "delivery after the step's end, all: 39 tokens" in out
    assert "over 2 ms late 2.6%" in out
    assert "delivery after the step's end, not waiting: 39 tokens" in out


def test_delivery_splits_tokens_by_whether_a_request_waited_for_its_first_token(tmp_path, capsys):
    gap_causes = load_module()
    constructed_run(tmp_path)
    records = json.loads((tmp_path / "records.json").read_text())
    stream = records["disaggregated"][0]
    # a second request arrives 0.56 s into the client's clock (steps 15 and 16 end at 0.55 and
    # 0.565 s) and waits until after the last step: steps 16-39 come while it waits
    records["disaggregated"].append({"index": 1, "kind": "long", "prompt_tokens": 900,
                                     "output_tokens": 1, "due_s": 0.56, "sent_s": 0.56,
                                     "token_times": [stream["token_times"][-1] + 0.1]})
    (tmp_path / "records.json").write_text(json.dumps(records))
    assert gap_causes.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "delivery after the step's end, waiting: 24 tokens" in out
    assert "delivery after the step's end, not waiting: 15 tokens" in out
    waiting = next(line for line in out.splitlines() if ", waiting:" in line)
    assert waiting.endswith("over 2 ms late 4.2%")  # step 30's token, 1 of 24


def test_a_run_without_step_lines_is_refused_naming_the_flag(tmp_path):
    gap_causes = load_module()
    constructed_run(tmp_path)
    log = tmp_path / "logs" / "disaggregated.log"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                           if "decode_service.steps" not in line))
    try:
        gap_causes.main([str(tmp_path)])
    except SystemExit as exc:
        assert "--decode-log-steps" in str(exc)
    else:
        raise AssertionError("no error for a run without step lines")


def test_a_run_without_disaggregated_records_is_refused_naming_why(tmp_path):
    gap_causes = load_module()
    constructed_run(tmp_path)
    (tmp_path / "records.json").write_text(json.dumps({"aggregated": []}))
    with pytest.raises(SystemExit, match="records.json has no disaggregated run"):
        gap_causes.main([str(tmp_path)])
