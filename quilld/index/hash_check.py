"""Proof that an engine's block hashes are the ones quilld computes for it (issue 30, item 2).

An engine with `prefix_caching_hash_algo` configured is credited, by the gateway and ROUTE, for
blocks whose hashes quilld computes from token ids (index/engine_hashes.py). If the engine
hashes otherwise (another algo, another PYTHONHASHSEED, another block size), nothing it holds
is ever credited, silently. vLLM's BlockStored events for GPU blocks carry the blocks' token
ids, their parent and per-block extra keys, so each such event can be hashed again here and
compared with what the engine sent: `HashCheck` counts the blocks that agree and those that
do not, and on the first disagreement logs, once per engine, the likely cause.

What one event lets us check exactly. An event carries each hash in its event form: by
default the low 64 bits of the digest, not the digest. The chain needs the parent's *full*
digest, so:

- an event with no parent (a prompt's first blocks) is checked in full: its first parent is
  NONE_HASH, from the configured seed, and each later block's parent is the digest just
  computed;
- an event whose parent is in bytes form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) is checked in
  full from that digest;
- an event whose parent is an int is checked when that parent was a block that agreed here
  before (its full digest is kept, `KNOWN` of them per engine); otherwise it cannot be, and is
  counted `unverifiable`, as are blocks of a LoRA adapter the engine's `lora_modules` does not
  name (the adapter's path is in the hash and not in the event; those it names are checked with
  that path) and blocks with extra keys other than a LoRA name and a cache salt (multimodal,
  prompt embeds: not covered by engine_hashes.py).

The cost is one hash per block (a few µs, bench/events_bench.py --hash-check): the first
`CHECK_FIRST` events of an engine are all checked, then one chain in `SAMPLE_EVERY`, i.e. a
root event (no parent) in `SAMPLE_EVERY` and the next `FOLLOW` events that continue a chain
checked here (a chain checked during the first events too gets `FOLLOW` more after them, not
the rest of a request that may run for thousands of decode blocks). Each later block of a chain
is hashed as the one before it, so following a chain further proves nothing new; it was most of
the check's cost. A misconfiguration shows on the first events; the sampling only keeps a steady
stream cheap. The check runs inside the subscriber's slices (an event's blocks are at most a slice's
worth), so it never holds the loop for long.

The check proves the hashing (algo, seed, block size, extra keys), not the tokenizer: the
events' token ids are the engine's own. A hash_seed is a secret: no log here shows it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from quilld.index.engine_hashes import ALGOS, RANDOM_SEED_ALGOS, EngineBlockHash, EngineHashing, Lora, SeedUnknown
from quilld.index.events import Event, Stored
from quilld.errors import ConfigError

log = logging.getLogger(__name__)

CHECK_FIRST = 64  # events of an engine checked in full before sampling starts
SAMPLE_EVERY = 16  # then one chain in this many: a root event in 16, and what continues it
FOLLOW = 4  # after the first events, a checked chain is followed this many events further
KNOWN = 4096  # full digests of agreeing blocks kept per engine, to check the events that continue them
_MASK = (1 << 64) - 1
RESULTS = ("agreed", "disagreed", "unverifiable")


class HashCheck:
    """One engine's check: `events(evs)` on each run of its events, `view()` for the figures."""

    __slots__ = ("engine_id", "hashing", "block_size", "counts", "cause", "state", "_seen", "_roots", "_known",
                 "_warned", "_loras", "_int_hashes", "_form_said")

    def __init__(self, engine_id: str, algo: str, hash_seed: str, block_size: int,
                 lora_modules: Sequence[tuple[str, str]] = (), int_hashes: bool = True) -> None:
        self.engine_id, self.block_size = engine_id, block_size
        self._int_hashes, self._form_said = int_hashes, False  # the form its config says (kv_event_hashes)
        self._loras = {name: Lora(name, path) for name, path in lora_modules}  # the engine's lora_modules
        self.counts = dict.fromkeys(RESULTS, 0)
        self.cause: str | None = None  # the likely cause of the first disagreement
        self.hashing: EngineHashing | None = None
        self._seen = self._roots = 0
        # event form -> (full digest, events of its chain checked since sampling started), oldest first;
        # an OrderedDict, as a plain dict emptied from the front makes each next(iter()) scan its holes
        self._known: OrderedDict[int | bytes, tuple[EngineBlockHash, int]] = OrderedDict()
        self._warned = False
        try:
            self.hashing = EngineHashing(algo, hash_seed or None, block_size)  # type: ignore[arg-type]
            self.state = "checking"
        except SeedUnknown:
            self.state = "seed_unknown"
            log.warning("engine %s: its block hashes cannot be checked or computed: with %s and no hash_seed, vLLM "
                        "draws a random seed per process. Set PYTHONHASHSEED on the engine and the same value as "
                        "its hash_seed, or use sha256", engine_id, algo)
        except ConfigError as e:
            self.state = "off"
            log.warning("engine %s: no block hash check: %s", engine_id, e.message)

    # -- the check ------------------------------------------------------------
    def events(self, events: Sequence[Event]) -> None:
        """Check the GPU BlockStored events among `events` that the sampling picks."""
        if self.hashing is None:
            return
        known = self._known
        for ev in events:
            if type(ev) is not Stored or not ev.token_ids or ev.medium not in (None, "GPU"):
                continue
            self._seen += 1
            if not self._form_said and ev.block_hashes and (ev.block_hashes[0].__class__ is int) != self._int_hashes:
                self._wrong_form(ev.block_hashes[0].__class__ is int)
            sampling = self._seen > CHECK_FIRST
            parent = ev.parent
            depth = 0
            if parent is None:
                self._roots += 1
                if sampling and self._roots % SAMPLE_EVERY:
                    continue
            elif sampling:
                entry = known.get(parent)
                if entry is None or entry[1] >= FOLLOW:
                    continue  # continues a chain not sampled, one that did not agree, or one followed far enough
                depth = entry[1] + 1
            self._check(ev, depth)

    def _check(self, ev: Stored, depth: int) -> None:
        """Hash `ev`'s blocks and count them; `depth`: how many events of its chain were checked
        since sampling started (0 for a root and during the first events)."""
        counts, hashes = self.counts, ev.block_hashes
        n = len(hashes)
        if ev.block_size != self.block_size:
            counts["disagreed"] += n
            self._explain(ev, None, None)
            return
        keys = self._keys(ev)
        if keys is None or len(ev.token_ids) != n * self.block_size:
            counts["unverifiable"] += n
            return
        lora, salt = keys
        parent = ev.parent
        if parent is not None:
            if parent.__class__ is int:
                entry = self._known.get(parent)
                if entry is None:
                    counts["unverifiable"] += n
                    return
                parent = entry[0]
            else:
                parent = EngineBlockHash(parent)
        assert self.hashing is not None
        ours = self.hashing.block_hashes(ev.token_ids, lora, salt, parent)
        agreed = 0
        known = self._known
        for theirs, mine in zip(hashes, ours):
            if not _agrees(theirs, mine):
                break
            agreed += 1
            known[theirs] = (mine, depth)
        while len(known) > KNOWN:
            known.popitem(last=False)
        counts["agreed"] += agreed
        if agreed < n:  # a block that differs: every later one in its chain differs too
            counts["disagreed"] += n - agreed
            self._explain(ev, salt, lora)

    def _keys(self, ev: Stored) -> tuple[Lora | None, str | None] | None:
        """The event's LoRA adapter and cache salt (None for none), or None when its extra keys are
        not checkable from the event: a LoRA adapter the engine's lora_modules does not name (its
        path is in the hash, not in the event), multimodal or embeds keys."""
        lora = None
        if ev.lora_name is not None or ev.lora_id is not None:
            lora = self._loras.get(ev.lora_name) if ev.lora_name is not None else None
            if lora is None:
                return None
        extra = ev.extra_keys
        if not extra:
            return (None, None) if lora is None else None  # a LoRA block's keys always name it
        salt = None
        lead = () if lora is None else (lora.name,)  # each block's untagged keys: [lora name] (+ salt)
        for i, keys in enumerate(extra):
            if keys is None:
                if lora is not None:
                    return None
                continue
            keys = tuple(keys)
            if keys[:len(lead)] != lead or any(k.__class__ is not str for k in keys):
                return None
            rest = keys[len(lead):]
            if not rest:
                continue
            if i or ev.parent is not None or len(rest) != 1:
                return None  # only a prompt's block 0 carries a salt, after the LoRA name
            salt = rest[0]
        return lora, salt

    def _wrong_form(self, ints: bool) -> None:
        """The events carry hashes in the other form than kv_event_hashes says: said once (the
        gateway's and ROUTE's engine hashes would never meet the events' in the index)."""
        self._form_said = True
        have, say = ("int", "bytes") if ints else ("bytes", "int")
        self.cause = (f"its KV events carry {have} block hashes, its config says kv_event_hashes = {say!r}"
                      f" (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={int(ints)} on the engine): set kv_event_hashes = {have!r}")
        log.warning("engine %s: %s; until then requests hashed the engine's way are not credited for its blocks",
                    self.engine_id, self.cause)

    # -- the likely cause -----------------------------------------------------
    def _explain(self, ev: Stored, salt: str | None, lora: Lora | None) -> None:
        """Log, once per engine, why its hashes are not ours, from the first event that disagrees."""
        if self._warned:
            return
        self._warned = True
        self.cause = cause = self._diagnose(ev, salt, lora)
        log.warning("engine %s: its KV events' block hashes are not the ones quilld computes for it (%s): "
                    "its blocks are not credited to requests until its config matches the engine", self.engine_id,
                    cause)

    def _diagnose(self, ev: Stored, salt: str | None, lora: Lora | None) -> str:
        assert self.hashing is not None
        mine, seed = self.hashing, self.hashing.hash_seed
        if ev.block_size != mine.block_size:
            why = f"the events' block_size is {ev.block_size}, the config's {mine.block_size}"
            fits = self._fits(ev, salt, lora, mine.algo, seed, ev.block_size) if ev.block_size > 0 else []
            return why + ("; with block_size " + str(ev.block_size) + " they agree" if fits else "")
        if ev.parent is not None:  # a continued chain whose parent agreed: not the algo nor the seed
            return ("a block continuing a chain that agreed differs: the extra keys (LoRA, cache salt, multimodal) "
                    "or the token ids as the engine hashed them")
        for algo in ALGOS:  # the seed as configured, another algo
            if algo != mine.algo and self._fits(ev, salt, lora, algo, seed, mine.block_size):
                return f"the engine hashes with {algo}, the config says prefix_caching_hash_algo = {mine.algo}"
        for algo in ALGOS:  # no seed on the engine (PYTHONHASHSEED unset), any algo it can be reproduced for
            if seed is not None and algo not in RANDOM_SEED_ALGOS and self._fits(ev, salt, lora, algo, None,
                                                                                 mine.block_size):
                return (f"the engine runs {algo} with PYTHONHASHSEED unset, the config gives a hash_seed"
                        + ("" if algo == mine.algo else f" and prefix_caching_hash_algo = {mine.algo}"))
        if lora is not None:
            return (f"no algo agrees for LoRA adapter {lora.name!r}: the path the engine loaded it from (part of "
                    f"every block's hash) likely differs from its lora_modules entry, or so do the seed and algo")
        if seed is None:
            return ("no algo agrees with PYTHONHASHSEED unset: the engine likely has a PYTHONHASHSEED (set hash_seed "
                    "to it) or runs xxhash with a random seed")
        return ("no algo agrees with the configured hash_seed nor with none: the engine's PYTHONHASHSEED likely "
                "differs from hash_seed")

    def _fits(self, ev: Stored, salt: str | None, lora: Lora | None, algo: str, seed: str | None, size: int) -> bool:
        """Whether the event's hashes agree with hashing done as given (the first block is enough)."""
        if ev.parent is not None or len(ev.token_ids) < size:
            return False
        try:
            other = EngineHashing(algo, seed, size)  # type: ignore[arg-type]
        except ConfigError:
            return False
        first = other.block_hashes(ev.token_ids[:size], lora, salt)
        return bool(first) and _agrees(ev.block_hashes[0], first[0])

    def view(self) -> dict:
        """The figures (INFO, /metrics, /v1/engines): never the seed."""
        return dict(self.counts, state=self.state, cause=self.cause)


def _agrees(theirs: int | bytes, mine: EngineBlockHash) -> bool:
    """Whether the engine's hash, in the form its event carries it, is `mine` (an int may come signed)."""
    if theirs.__class__ is int:
        return theirs & _MASK == int.from_bytes(mine[-8:], "big")
    return theirs == mine


__all__ = ["CHECK_FIRST", "FOLLOW", "HashCheck", "KNOWN", "RESULTS", "SAMPLE_EVERY"]
