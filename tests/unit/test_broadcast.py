"""quilld/cluster/broadcast.py: membership news goes out before meta refreshes, however fresh
those are (issue 32, item 6), and least-sent first within each."""

from __future__ import annotations

from quilld.cluster.broadcast import BroadcastQueue


def test_failure_news_already_sent_goes_before_fresh_meta_refreshes():
    q = BroadcastQueue()
    q.push("dead-node", "DEAD dead-node", 30)
    for _ in range(3):
        assert q.select(room=1400, limit=10, max_count=1) == ["DEAD dead-node"]
    for i in range(20):  # every node's meta changed since: fresh, never sent
        q.push(f"n{i}", f"ALIVE n{i} meta", 250, urgent=False)
    # one update a packet: the death again (sent 3 times), not the newest meta
    assert q.select(room=1400, limit=10, max_count=1) == ["DEAD dead-node"]
    # a packet with room for more: the news first, then meta refreshes, newest first
    assert q.select(room=600, limit=10, max_count=8) == ["DEAD dead-node", "ALIVE n19 meta", "ALIVE n18 meta"]


def test_a_newer_update_about_a_member_replaces_the_older_and_takes_its_rank():
    q = BroadcastQueue()
    q.push("a", "ALIVE a meta", 100, urgent=False)
    q.push("b", "SUSPECT b", 30)
    q.push("a", "SUSPECT a", 30)  # news about a now: urgent, the meta refresh gone
    assert q.select(room=1400, limit=10, max_count=8) == ["SUSPECT a", "SUSPECT b"]
    assert len(q) == 2
