"""tests/history_check.py, the checker the randomized cluster test relies on: each rule catches the
history that breaks it, and lets through the ones the model allows."""

from __future__ import annotations

from history_check import Fault, Op, check


def w(node, key, value, start, end=None, ok=True):
    return Op("set", node, key, value, start, start + 0.01 if end is None else end, ok)


def d(node, key, start):
    return Op("del", node, key, None, start, start + 0.01)


def r(node, key, value, start):
    return Op("get", node, key, value, start, start + 0.01)


def test_an_allowed_history_has_no_findings():
    ops = [w("a", "k", "v1", 0.0), r("b", "k", "v1", 0.1), w("b", "k", "v2", 0.2), r("a", "k", "v1", 0.25),
           r("a", "k", "v2", 0.4), r("c", "k", None, 0.5)]
    assert check(ops, [], {"a": {"k": "v2"}, "b": {"k": "v2"}}) == []


def test_invented_and_future_values():
    assert any(f.startswith("invented") for f in check([r("a", "k", "zz", 1.0)], []))
    ops = [r("a", "k", "v1", 0.0), w("b", "k", "v1", 1.0)]
    assert any(f.startswith("from the future") for f in check(ops, []))


def test_a_node_going_back_is_caught_unless_a_kill_came_between():
    ops = [w("a", "k", "v1", 0.0), w("a", "k", "v2", 0.1), r("b", "k", "v2", 0.2), r("b", "k", "v1", 0.3)]
    assert any(f.startswith("went back") for f in check(ops, []))
    assert not any(f.startswith("went back") for f in check(ops, [Fault("kill", 0.25, "a")]))
    concurrent = [w("a", "k", "v1", 0.0, 0.2), w("b", "k", "v2", 0.1, 0.3), r("c", "k", "v2", 0.4),
                  r("c", "k", "v1", 0.5)]
    assert not any(f.startswith("went back") for f in check(concurrent, []))  # either may win


def test_a_value_older_than_an_answered_write_is_stale_after_the_window_without_faults():
    ops = [w("a", "k", "v1", 0.0), w("b", "k", "v2", 20.0), r("c", "k", "v1", 21.0), r("c", "k", "v1", 23.0)]
    found = check(ops, [])
    assert len([f for f in found if f.startswith("stale too long")]) == 1  # 21.0 is inside the window
    assert not any(f.startswith("stale") for f in check(ops, [Fault("heal", 18.0)]))  # a fault just before
    deleted = [w("a", "k", "v1", 0.0), d("b", "k", 20.0), r("c", "k", "v1", 23.0)]
    assert any("a DEL" in f for f in check(deleted, []))


def test_the_end_state_must_agree_and_be_the_last_kept_write():
    ops = [w("a", "k", "v1", 0.0), w("b", "k", "v2", 1.0)]
    assert any(f.startswith("disagree") for f in check(ops, [], {"a": {"k": "v2"}, "b": {"k": "v1"}}))
    assert any(f.startswith("lost") for f in check(ops, [], {"a": {"k": "v1"}, "b": {"k": "v1"}}))
    assert any(f.startswith("lost") for f in check(ops, [], {"a": {"k": None}, "b": {"k": None}}))
    killed = [Fault("kill", 1.5, "b")]  # v2's node died after it: v1 or nil is what the pool may have
    assert check(ops, killed, {"a": {"k": "v1"}}) == [] and check(ops, killed, {"a": {"k": None}}) == []
    gone = ops + [d("c", "k", 2.0)]
    assert any(f.startswith("lost") for f in check(gone, [], {"a": {"k": "v2"}, "c": {"k": "v2"}}))
    assert check(gone, [], {"a": {"k": None}, "c": {"k": None}}) == []
    failed = [w("a", "k", "v1", 0.0), w("b", "k", "v2", 1.0, ok=False)]  # may or may not have happened
    assert check(failed, [], {"a": {"k": "v2"}}) == [] and check(failed, [], {"a": {"k": "v1"}}) == []
