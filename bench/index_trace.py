"""The trace of the residency index's study (bench/index_study.py): vLLM-shaped KV events for 16
engines, written once and streamed by every backend's process.

16 engines serving one model; 32 shared system prompts (4-16 blocks); 512 live multi-turn
sessions, each turn the previous prompt plus 2-8 new blocks (chained hashes), served by the
session's engine (one in ten turns moves to another engine); each engine stores the blocks it
lacked in HBM (BlockStored GPU), evicts its least recently used HBM blocks to its CPU tier
(BlockRemoved GPU + BlockStored CPU) and drops CPU blocks past that tier's size (BlockRemoved
CPU); sized so the index ends with about `target` entries. Events go in batches of 64 per engine,
as vLLM's publisher sends them.
"""

from __future__ import annotations

import pickle
import random
from collections import Counter, OrderedDict
from pathlib import Path

ENGINES = 16
BATCH = 64
WALK = 32
SYSTEMS = 32
SESSIONS = 512


def make_trace(path: Path, target: int, seed: int = 23) -> dict:
    """Write the trace (pickled batches: engine, seq, [(kind, medium, hashes)]) and the probes."""
    rng = random.Random(seed)
    # the caches hold 1.35x `target` residencies: blocks cached by several engines (system prompts,
    # sessions that moved) make the index's entries fewer than that, about `target`
    hbm_cap = int(target * 0.75 / ENGINES)
    cpu_cap = int(target * 0.60 / ENGINES)
    systems = [[rng.getrandbits(64) for _ in range(rng.randint(4, 16))] for _ in range(SYSTEMS)]
    hbm = [OrderedDict() for _ in range(ENGINES)]
    cpu = [OrderedDict() for _ in range(ENGINES)]
    holders: Counter[int] = Counter()  # hash -> (engine, tier) pairs holding it: the index's entries
    pending: list[list] = [[] for _ in range(ENGINES)]
    seqs = [0] * ENGINES
    stats = Counter()

    def new_session() -> dict:
        return {"engine": rng.randrange(ENGINES), "prompt": list(rng.choice(systems)), "turns": rng.randint(1, 12)}

    sessions = [new_session() for _ in range(SESSIONS)]
    probes: list[list[int]] = []
    out = open(path, "wb")

    def emit(e: int, event) -> None:
        pending[e].append(event)
        stats["events"] += 1
        stats["blocks"] += len(event[2])
        if len(pending[e]) == BATCH:
            pickle.dump((e, seqs[e], pending[e]), out, protocol=5)
            seqs[e] += 1
            stats["batches"] += 1
            pending[e] = []

    churn_turns = None
    turns = 0
    while True:
        turns += 1
        i = rng.randrange(SESSIONS)
        s = sessions[i]
        if rng.random() < 0.1:
            s["engine"] = rng.randrange(ENGINES)
        e = s["engine"]
        s["prompt"] += [rng.getrandbits(64) for _ in range(rng.randint(2, 8))]
        prompt = s["prompt"]
        h, c = hbm[e], cpu[e]
        new = [b for b in prompt if b not in h]
        for b in prompt:
            if b in h:
                h.move_to_end(b)
            else:
                h[b] = None
                holders[b] += 1
        if new:
            emit(e, ("stored", "GPU", tuple(new)))
        if len(h) > hbm_cap:
            out_hbm = [h.popitem(last=False)[0] for _ in range(len(h) - hbm_cap)]
            for b in out_hbm:
                holders[b] -= 1
            emit(e, ("removed", "GPU", tuple(out_hbm)))
            offload = [b for b in out_hbm if b not in c]
            for b in out_hbm:
                if b in c:
                    c.move_to_end(b)
                else:
                    c[b] = None
                    holders[b] += 1
            if offload:
                emit(e, ("stored", "CPU", tuple(offload)))
            if len(c) > cpu_cap:
                out_cpu = [c.popitem(last=False)[0] for _ in range(len(c) - cpu_cap)]
                for b in out_cpu:
                    holders[b] -= 1
                    if not holders[b]:
                        del holders[b]
                emit(e, ("removed", "CPU", tuple(out_cpu)))
        s["turns"] -= 1
        if s["turns"] <= 0 or len(prompt) > 96:
            if churn_turns is not None and len(probes) < 4000:
                probes.append(prompt[:WALK])
            sessions[i] = new_session()
        if churn_turns is None and all(len(x) >= hbm_cap for x in hbm) and all(len(x) >= cpu_cap for x in cpu):
            churn_turns = turns // 5  # a fifth more turns: a steady state with evictions
        if churn_turns is not None:
            churn_turns -= 1
            if churn_turns <= 0:
                break
    for e in range(ENGINES):
        if pending[e]:
            pickle.dump((e, seqs[e], pending[e]), out, protocol=5)
            stats["batches"] += 1
    out.close()
    for s in sessions:  # live sessions' prompts too, padded with the next turn's new blocks
        if len(probes) >= 6000:
            break
        p = s["prompt"][:WALK]
        probes.append(p + [rng.getrandbits(64) for _ in range(WALK - len(p))])
    probes = [p + [rng.getrandbits(64) for _ in range(WALK - len(p))] for p in probes]
    rng.shuffle(probes)
    return {"entries": len(holders), "residencies": sum(holders.values()), "turns": turns, **stats,
            "probes": probes, "hbm_cap": hbm_cap, "cpu_cap": cpu_cap}


def read_trace(path: Path):
    with open(path, "rb") as f:
        while True:
            try:
                yield pickle.load(f)
            except EOFError:
                return


def to_events(raw):
    from quilld.index.events import Removed, Stored

    return [Stored(h, None, (), 16, None, m) if k == "stored" else Removed(h, m) for k, m, h in raw]
