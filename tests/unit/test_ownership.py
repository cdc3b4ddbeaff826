"""Rendezvous ownership over virtual buckets: exact against brute force, stable, balanced."""

from __future__ import annotations

import random

import numpy as np
import pytest

from quilld.cluster import ownership as ow


def brute_force(buckets: int, replicas: int, members: dict[str, float]) -> list[tuple[str, ...]]:
    """Every member scored for every bucket, the best `replicas` taken: the definition."""
    seeds = ow._mix(np.arange(buckets, dtype=np.uint64) + np.uint64(ow._SALT))
    names = sorted(members)
    if not names:
        return [()] * buckets
    m = np.stack([ow._column(seeds, n, members[n]) for n in names], axis=1)
    order = np.argsort(-m, axis=1)[:, :replicas]
    return [tuple(names[j] for j in row) for row in order]


@pytest.mark.parametrize("buckets,replicas", [(512, 3), (256, 1), (256, 5)])
def test_every_view_reached_by_joins_and_departures_matches_brute_force(buckets: int, replicas: int) -> None:
    rng = random.Random(buckets * 7 + replicas)
    own = ow.Ownership(buckets, replicas)
    names = [f"n{i}" for i in range(40)]
    members: dict[str, float] = {}
    for _ in range(150):
        if members and rng.random() < 0.45:
            for m in rng.sample(sorted(members), rng.randint(1, min(8, len(members)))):
                del members[m]
        else:
            for m in rng.sample(names, rng.randint(1, 6)):
                members[m] = 1.0
        own.update(dict(members))
        want = brute_force(buckets, replicas, members)
        assert [own.owners(b) for b in range(buckets)] == want


def test_weights_give_a_proportional_share_and_a_weight_change_is_exact() -> None:
    own = ow.Ownership(4096, 1, weighted=True)
    members = {"small": 1.0, "big": 3.0}
    own.update(members)
    share = len(own.owned_by("big")) / 4096
    assert 0.70 < share < 0.80  # 3 / (1 + 3)
    members["small"] = 3.0
    own.update(members)
    assert [own.owners(b) for b in range(4096)] == brute_force(4096, 1, members)


def test_a_join_moves_only_what_the_newcomer_takes_and_a_departure_only_what_it_had() -> None:
    own = ow.Ownership(8192, 3)
    members = {f"n{i}": 1.0 for i in range(50)}
    own.update(members)
    before = {b: own.owners(b) for b in range(8192)}
    changed = set(own.update({**members, "new": 1.0}).tolist())
    assert changed == {b for b in range(8192) if "new" in own.owners(b)}
    assert all(set(own.owners(b)) - {"new"} <= set(before[b]) for b in changed)
    assert 0.5 * 3 * 8192 / 51 < len(changed) < 1.5 * 3 * 8192 / 51
    gone = set(own.update(members).tolist())
    assert gone == changed and all(own.owners(b) == before[b] for b in range(8192))


def test_two_nodes_with_the_same_view_agree_whatever_order_they_learnt_it_in() -> None:
    a, b = ow.Ownership(1024, 3), ow.Ownership(1024, 3)
    names = [f"m{i}" for i in range(30)]
    for i in range(1, 31):
        a.update({n: 1.0 for n in names[:i]})
    b.update({n: 1.0 for n in names[5:]})
    b.update({n: 1.0 for n in names})
    assert [a.owners(x) for x in range(1024)] == [b.owners(x) for x in range(1024)]


def test_owned_by_lists_exactly_the_buckets_a_member_owns() -> None:
    own = ow.Ownership(2048, 3)
    own.update({f"n{i}": 1.0 for i in range(12)})
    for i in range(12):
        n = f"n{i}"
        assert set(own.owned_by(n).tolist()) == {b for b in range(2048) if n in own.owners(b)}
    assert len(own.owned_by("nobody")) == 0


def test_fewer_members_than_replicas_means_every_member_owns_everything() -> None:
    own = ow.Ownership(256, 3)
    own.update({"a": 1.0, "b": 1.0})
    assert all(set(own.owners(b)) == {"a", "b"} for b in range(256))
    own.update({"a": 1.0})
    assert all(own.owners(b) == ("a",) for b in range(256))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        ow.Ownership(1000, 3)
    with pytest.raises(ValueError, match="replicas"):
        ow.Ownership(1024, 0)
