"""Prefix-cache reports: the workers' journal of stored and evicted blocks
(nxdi_common.cache_journal, fed by the BlockManager), its wire form in GetLoad, and the router's
view of it (router.prefix_index.ReportedCache, the registry applying reports, the cache-aware
policy reading them). The same against real worker processes is in test_serving_load.py."""
from __future__ import annotations

import random
import threading
import time

import pytest

from nxdi_common.block_manager import BlockManager
from nxdi_common.cache_journal import MASK64, CacheJournal, CacheReport
from nxdi_common.serving.convert import (cache_report_for, cache_report_from_proto,
                                         cache_report_to_proto)
from protos.nxdi.serving.v1 import serving_pb2 as pb
from router.policies import DECODE, CacheAware, WorkerLoad, WorkerState
from router.prefix_index import PrefixIndex, ReportedCache, block_hashes
from router.registry import Registry
from router.server import build_parser, settings_from_args


def low(hashes):
    return {h & MASK64 for h in hashes}


# --- the journal ---------------------------------------------------------------------------------


def test_journal_reports_net_changes_since_a_cursor():
    j = CacheJournal()
    first = j.since(0, 0)
    assert first.snapshot and first.stored == () and first.seq == 0 and first.instance != 0
    j.stored(1)
    j.stored(2)
    at2 = j.seq
    j.stored(3)
    j.removed(1)
    j.stored(1)  # stored again: held now
    j.removed(2)
    j.stored((5 << 64) | 4)  # reported by its low 64 bits
    report = j.since(first.instance, at2)
    assert not report.snapshot and report.seq == 7
    assert report.stored == (1, 3, 4) and report.removed == (2,)  # 1: net stored; 2: removed
    assert j.since(first.instance, 0) == CacheReport(first.instance, 7, False, (1, 3, 4), (2,))
    assert j.since(first.instance, 7) == CacheReport(first.instance, 7, False, (), ())
    assert len(j) == 3


def test_journal_gives_a_snapshot_to_a_stranger_or_a_reader_left_behind():
    j = CacheJournal(max_events=4)
    for h in range(10):
        j.stored(h)
    j.removed(9)
    other = j.since(j.instance + 1, 11)  # another instance's cursor (a restarted worker)
    assert other.snapshot and other.stored == tuple(range(9)) and other.seq == 11
    behind = j.since(j.instance, 6)  # the log keeps changes 8..11 only
    assert behind.snapshot and behind.stored == tuple(range(9))
    kept = j.since(j.instance, 7)
    assert not kept.snapshot and kept.stored == (7, 8) and kept.removed == (9,)
    ahead = j.since(j.instance, 12)  # from the future: not this journal's
    assert ahead.snapshot
    with pytest.raises(ValueError, match="max_events"):
        CacheJournal(max_events=0)
    assert CacheJournal().instance != CacheJournal().instance


def test_journal_follows_a_block_manager_through_sealing_and_eviction():
    """Every block entering the hash index is reported stored, every one allocation reuses
    reported removed; a reader applying reports in turn ends where a snapshot is."""
    bm = BlockManager(num_blocks=8, block_size=4)
    view = ReportedCache()
    view.apply(bm.journal.since(*view.cursor), 1)
    a = list(range(100, 121))  # 5 full blocks and 1 token
    bm.allocate("a", a)
    bm.mark_computed("a", len(a))
    view.apply(bm.journal.since(*view.cursor), 2)
    assert view.blocks == low(block_hashes(a, 4))
    bm.free("a")  # freed, still cached
    view.apply(bm.journal.since(*view.cursor), 3)
    assert view.blocks == low(block_hashes(a, 4))
    b = list(range(500, 524))  # 6 blocks: 3 free unhashed, then a's deepest three evicted
    bm.allocate("b", b)
    bm.mark_computed("b", len(b))
    report = bm.journal.since(*view.cursor)
    assert not report.snapshot
    assert set(report.removed) == low(block_hashes(a, 4)[2:])
    assert set(report.stored) == low(block_hashes(b, 4))
    view.apply(report, 4)
    held = low(block_hashes(a, 4)[:2]) | low(block_hashes(b, 4))
    assert view.blocks == held == set(bm.journal.since(0, 0).stored)
    bm.check_integrity()


def test_journal_is_safe_to_read_while_the_cache_changes():
    j, stop, errors = CacheJournal(max_events=64), threading.Event(), []

    def write():
        rng = random.Random(0)
        while not stop.is_set():
            (j.stored if rng.random() < 0.6 else j.removed)(rng.randrange(200))

    writer = threading.Thread(target=write)
    writer.start()
    view = ReportedCache()
    try:
        for _ in range(2000):
            view.apply(j.since(*view.cursor), 0)
    except Exception as exc:  # noqa: BLE001 - reported below
        errors.append(exc)
    finally:
        stop.set()
        writer.join()
    view.apply(j.since(*view.cursor), 0)
    assert not errors and view.blocks == set(j.since(0, 0).stored)


# --- on the wire ---------------------------------------------------------------------------------


def test_get_load_carries_a_report_only_when_asked():
    j = CacheJournal()
    j.stored(2**64 - 1)
    assert cache_report_for(pb.GetLoadRequest(), j) is None  # no cursor: not asked
    asked = pb.GetLoadRequest(cache_cursor=pb.CacheCursor(instance=0, seq=0))
    assert cache_report_for(asked, None) is None  # no prefix cache
    msg = cache_report_for(asked, j)
    wire = pb.WorkerLoad.FromString(pb.WorkerLoad(prefix_cache=msg).SerializeToString())
    assert cache_report_from_proto(wire.prefix_cache) == j.since(0, 0)
    report = CacheReport(7, 9, False, (1, 2**64 - 1), (3,))
    assert cache_report_from_proto(cache_report_to_proto(report)) == report


# --- the router's view ---------------------------------------------------------------------------


def test_prefix_index_counts_reported_blocks_and_only_newer_routes():
    """A worker's report decides for the routes the router sent before asking for it; routes
    sent after count until the next report."""
    index, prompt = PrefixIndex(), list(range(64))
    hashes = block_hashes(prompt, 16)
    index.record("w:1", hashes, capacity_blocks=100)
    assert index.matched_blocks("w:1", hashes) == 4  # no report: what was sent
    reported = ReportedCache()
    reported.apply(CacheReport(5, 1, True, tuple(low(hashes[:2]))), time.monotonic_ns())
    assert index.matched_blocks("w:1", hashes, reported) == 2  # the worker kept two
    index.record("w:1", hashes, capacity_blocks=100)  # sent again after the report
    assert index.matched_blocks("w:1", hashes, reported) == 4
    reported.apply(CacheReport(5, 2, False, (), tuple(low(hashes))), time.monotonic_ns())
    assert index.matched_blocks("w:1", hashes, reported) == 0  # evicted since
    reported.apply(CacheReport(6, 1, True, tuple(low(hashes[:1]))), time.monotonic_ns())
    assert reported.cursor == (6, 1) and index.matched_blocks("w:1", hashes, reported) == 1


def test_cache_aware_routes_by_the_workers_reports_over_what_it_sent():
    """Turn 1 went to a:1, which has since evicted it (its report says so) while b:1 holds
    it (b:1 got the same prompt from another router): turn 2 goes to b:1. Without reports it
    would go back to a:1."""
    turn1 = list(range(1000, 1320))  # 20 blocks
    turn2 = turn1 + list(range(5000, 5064))

    def worker(address):
        load = WorkerLoad(kv_blocks_used=0, kv_blocks_free=100, kv_block_size=16, role=DECODE)
        return WorkerState(address, DECODE, True, load, "")

    a, b = worker("a:1"), worker("b:1")
    policy = CacheAware()
    policy.note_routed(turn1, a, None)
    assert [w.address for w in policy.rank_decode(turn2, [a, b])] == ["a:1", "b:1"]
    asked = time.monotonic_ns()
    a.cache, b.cache = ReportedCache(), ReportedCache()
    a.cache.apply(CacheReport(1, 40, True, ()), asked)
    b.cache.apply(CacheReport(2, 20, True, tuple(low(block_hashes(turn1, 16)))), asked)
    assert [w.address for w in policy.rank_decode(turn2, [a, b])] == ["b:1", "a:1"]
    assert policy.matched_blocks(turn2, b) == 20 and policy.matched_blocks(turn2, a) == 0


def test_registry_applies_reports_and_drops_the_view_of_a_worker_that_sends_none():
    registry = Registry({DECODE: ["127.0.0.1:1"]})
    w = registry.workers(DECODE)[0]
    load = WorkerLoad(kv_block_size=16, role=DECODE,
                      prefix_cache=CacheReport(3, 2, True, (10, 11)))
    kept = registry._apply_cache_report(w, load, 123)
    assert kept.prefix_cache is None and w.cache.blocks == {10, 11} and w.cache.asked_ns == 123
    registry._apply_cache_report(
        w, WorkerLoad(prefix_cache=CacheReport(3, 4, False, (12,), (10,))), 124)
    assert w.cache.blocks == {11, 12} and w.cache.cursor == (3, 4)
    registry._apply_cache_report(w, WorkerLoad(), 125)  # asked, none sent: an older worker
    assert w.cache is None
    quiet = Registry({DECODE: ["127.0.0.1:1"]}, cache_reports=False)
    assert not quiet.cache_reports


def test_router_command_line_turns_cache_reports_off():
    assert settings_from_args(build_parser().parse_args(["--decode", "d:1"])).cache_reports
    args = build_parser().parse_args(["--decode", "d:1", "--no-cache-reports"])
    assert settings_from_args(args).cache_reports is False
