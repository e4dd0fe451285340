"""Incremental detokenization and stop strings: exact text, multi-byte characters, hold-back."""
import pytest

from decode_service.scheduler import (DecodeScheduler, piece_costs_a_tpot, split_by_length,
                                      stall_budget_s)
from nxdi_common.serving.detokenize import IncrementalDetokenizer, OutputText, StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(bundled_model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bundled_model_path)


@pytest.mark.parametrize("text", ["Hello, world! It's 42°C in Zürich — naïve café 東京 🚀🚀.",
                                  "  leading spaces\n\nand\ttabs  ", "def f(x):\n    return x"])
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text):
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_emoji_split_over_byte_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer("🚀").input_ids
    assert len(ids) > 1  # byte-level pieces
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🚀"


def test_stop_string_holds_back_a_possible_start_then_cuts():
    m = StopStringMatcher(["STOP"])
    assert [m.feed(x) for x in ["ab", "cS", "T", "x"]] == ["ab", "c", "", "STx"]
    assert m.matched is None
    assert [m.feed(x) for x in ["yyST", "OPzz"]] == ["yy", ""]
    assert m.matched == "STOP" and m.feed("more") == "" and m.flush() == ""


def test_earliest_stop_string_wins_and_flush_releases_held_text():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel" and m.matched == "lo w"
    m2 = StopStringMatcher(["abc"])
    assert m2.feed("xab") == "x" and m2.flush() == "ab"


def test_output_text_stops_inside_a_token(tokenizer):
    ids = tokenizer("one two three four").input_ids
    out = OutputText(tokenizer, ["thr"])
    pieces = []
    for i in ids:
        text, stopped = out.add(i)
        pieces.append(text)
        if stopped:
            break
    assert "".join(pieces) == "one two " and out.stopped


def test_scheduler_joins_waiting_sequences_into_the_lowest_free_slots():
    class S:
        slot, priority = -1, 0
    sched = DecodeScheduler(2)
    a, b, c = S(), S(), S()
    for s in (a, b, c):
        sched.add_ready(s)
    assert sched.next_batch() == [a, b] and (a.slot, b.slot) == (0, 1)
    assert sched.num_waiting == 1
    sched.remove(a)
    assert a.slot == -1 and sched.next_batch() == [c, b] and c.slot == 0
    sched.remove(c)
    sched.remove(b)
    assert sched.next_batch() == [] and sched.num_running == 0


LENGTHS, BATCHES = [128, 256, 512, 1024, 2048], [1, 2, 4, 8, 16]


def test_one_long_sequence_runs_apart_from_many_short_ones():
    # 15 rows need <= 128 positions, one needs 2000: one call would attend 16 x 2048; apart it
    # is 16 x 128 + 1 x 2048 plus the cost of the second call.
    needed = [100] * 7 + [2000] + [120] * 8
    groups = split_by_length(needed, LENGTHS, BATCHES, call_cost_row_tokens=6000)
    assert groups == [[i for i in range(16) if i != 7], [7]]
    # The same batch when a second call costs more than the padding it saves: one call.
    assert split_by_length(needed, LENGTHS, BATCHES, call_cost_row_tokens=40000) == [
        sorted(range(16), key=lambda i: needed[i])]


def test_split_picks_the_cheapest_cut_and_never_splits_one_bucket():
    needed = [100, 900, 1000, 120, 2000, 110]
    # Batch buckets count too: after 4 rows (4x1024 + 2x2048 = 8192) beats after 3 rows
    # (4x128 + 4x2048 = 8704), after 5 (8x1024 + 2048) and one call (8x2048).
    assert split_by_length(needed, LENGTHS, BATCHES, 0) == [[0, 5, 3, 1], [2, 4]]
    assert split_by_length([300, 400, 500], LENGTHS, BATCHES, 0) == [[0, 1, 2]]
    assert split_by_length([5], LENGTHS, BATCHES, 0) == [[0]]


def test_a_piece_waits_only_for_a_sequence_it_would_push_over_the_tpot_target():
    """(seconds since first token, tokens, max_tokens): TPOT projected with the remaining tokens
    at the step time, with and without the piece; only a sequence the piece would flip from
    meeting the target to missing it holds the piece back."""
    step, target = 0.02, 0.1
    # 10 of 20 tokens in 0.9 s: 0.9 + 10 * 0.02 = 1.1 s over 19 gaps = 58 ms without the piece;
    # a 0.7 s piece makes it 95 ms (not over), a 0.9 s piece 105 ms (over)
    assert not piece_costs_a_tpot([(0.9, 10, 20)], 0.7, step, target)
    assert piece_costs_a_tpot([(0.9, 10, 20)], 0.9, step, target)
    # the same piece costs little TPOT to a sequence with many tokens to share it
    assert not piece_costs_a_tpot([(0.9, 10, 200)], 0.9, step, target)
    # one sequence at risk is enough; one missing anyway (2.5 s for 10 tokens) holds nothing
    assert piece_costs_a_tpot([(0.1, 2, 100), (0.9, 10, 20)], 0.9, step, target)
    assert not piece_costs_a_tpot([(2.5, 10, 20)], 0.9, step, target)
    # nothing to project: no first token yet, a one-token request, one already done
    assert not piece_costs_a_tpot([(0.0, 0, 20), (0.0, 1, 1), (3.0, 20, 20)], 5.0, step, target)
    assert not piece_costs_a_tpot([], 5.0, step, target)


def test_the_stall_budget_is_what_the_tightest_sequence_can_take_within_the_tpot_target():
    """stall_budget_s: the least, over the sequences that would meet the target, of the stall
    that keeps their projected TPOT within ``share`` of it; None when none limits it."""
    step, target = 0.02, 0.1
    # 10 of 20 tokens in 0.9 s: projected 1.1 s of the 1.9 s that 19 gaps at 100 ms allow
    assert stall_budget_s([(0.9, 10, 20)], step, target) == pytest.approx(0.8)
    assert stall_budget_s([(0.9, 10, 20)], step, target, share=0.9) == pytest.approx(0.61)
    # the tightest sequence sets it; one with many tokens to share a stall has more room
    assert stall_budget_s([(0.9, 10, 200), (0.9, 10, 20)], step, target) == pytest.approx(0.8)
    assert stall_budget_s([(0.9, 10, 200)], step, target) == pytest.approx(19.9 - 0.9 - 3.8)
    # within the target but not its share: none left (below 0); missing it anyway: no limit
    assert stall_budget_s([(1.6, 10, 20)], step, target, share=0.9) == pytest.approx(-0.09)
    assert stall_budget_s([(2.5, 10, 20)], step, target) is None
    assert stall_budget_s([(0.0, 0, 20), (0.0, 1, 1), (3.0, 20, 20)], step, target) is None
    assert stall_budget_s([], step, target) is None
