"""vLLM 0.33's prefix-cache block hashes, computed from token ids as the engine computes them.

An engine names its KV blocks by a chain of hashes (vllm/v1/core/kv_cache_utils.py:
`hash_block_tokens`, `get_request_block_hasher`, `generate_block_hash_extra_keys`;
vllm/utils/hashing.py for the hash functions). Block i of a prompt, for every *full*
block of `block_size` tokens (a partial last block has no hash), is

    hash_fn((parent, tuple(token_ids of block i), extra_keys))

where `parent` is block i-1's hash, or NONE_HASH for block 0, and `hash_fn` is the
engine's `prefix_caching_hash_algo`: `sha256` (SHA-256 of the tuple pickled with the highest
protocol, 5), `sha256_cbor` (SHA-256 of `cbor2.dumps(..., canonical=True)`), `xxhash` and
`xxhash_cbor` (the same serialisations, XXH3-128). A hash is the 32 or 16 digest bytes.

- NONE_HASH is `hash_fn(seed)`, the seed a str: the engine's PYTHONHASHSEED when it is set;
  unset, "vllm-none-hash" for the sha256 algos and fresh random bytes per process for the
  xxhash ones, which no one outside that process can know. `EngineHashing` refuses that
  combination (`SeedUnknown`) rather than compute hashes no engine would.
- `extra_keys` is None, or a tuple of tagged keys in this order: `("lora", name, path)` for a
  LoRA request (its adapter's path too), multimodal keys (not covered here), `("cache_salt",
  salt)` on block 0 only when the salt is non-empty, prompt-embeds digests (not covered).
- A KV event (`BlockStored`) carries each hash in its *event form*: by default
  (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) the digest's last 8 bytes as a big-endian
  unsigned int (`maybe_convert_block_hash`), else the digest bytes; its `extra_keys` are
  untagged, one entry per block: `[lora name, salt]`, `[lora name]`, `[salt]` or None.

`EngineBlockHash` is the engine's name for a block, never a pool key: quilld keys what it
stores otherwise (index/handoff.py), and the two do not mix.
tests/unit/test_engine_hashes.py checks all of this against vectors made by vLLM's own code
(tools/make_vllm_hash_fixtures.py). Not covered yet: multimodal and prompt-embeds keys,
lookahead hashing (speculative decoding's `num_hash_lookahead_tokens`) and a hash block size
other than the engine's block size. A chat request's token ids come from quilld/index/chat_render.py.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import cbor2
import xxhash

from quilld.config import PREFIX_HASH_ALGOS
from quilld.errors import ConfigError

Algo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ALGOS: tuple[Algo, ...] = PREFIX_HASH_ALGOS  # type: ignore[assignment]
DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for the sha256 algos with PYTHONHASHSEED unset
RANDOM_SEED_ALGOS = frozenset({"xxhash", "xxhash_cbor"})  # ... and these draw a random one instead
PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on every Python vLLM 0.33 runs on (3.10-3.13)
EVENT_MASK = (1 << 64) - 1


class SeedUnknown(ConfigError):
    """The engine's NONE_HASH comes from a seed quilld cannot know."""


class EngineBlockHash(bytes):
    """A block's hash as the engine keeps it in memory (vLLM's `BlockHash`: the digest bytes)."""

    __slots__ = ()

    def event_form(self, int_hashes: bool = True) -> int | bytes:
        """The hash as a KV event carries it: the low 64 bits of the digest read big-endian, or
        (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) the digest bytes."""
        return int.from_bytes(self, "big") & EVENT_MASK if int_hashes else bytes(self)


@dataclass(frozen=True, slots=True)
class Lora:
    """A LoRA adapter as the engine loaded it: the name requests use and the path it was loaded from."""

    name: str
    path: str


def _serialize_pickle(key: tuple) -> bytes:
    return pickle.dumps(key, protocol=PICKLE_PROTOCOL)


def _serialize_cbor(key: tuple) -> bytes:
    return cbor2.dumps(key, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_FUNCTIONS = {"sha256": (_serialize_pickle, _sha256), "sha256_cbor": (_serialize_cbor, _sha256),
              "xxhash": (_serialize_pickle, xxhash.xxh3_128_digest),
              "xxhash_cbor": (_serialize_cbor, xxhash.xxh3_128_digest)}


def _fresh(s: str) -> str:
    """An equal str that is not `s` itself. pickle writes a str it has written already in the same
    tuple as a back-reference (by identity): the engine's keys hold strings parsed apart (a LoRA's
    name and path, a request's salt), never one object twice, and so must ours."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class EngineHashing:
    """How one engine hashes blocks: its `prefix_caching_hash_algo`, its PYTHONHASHSEED (None:
    unset) and its block size in tokens."""

    algo: Algo
    hash_seed: str | None
    block_size: int
    none_hash: EngineBlockHash = field(init=False, repr=False, compare=False)  # block 0's parent
    _serialize: Callable[[object], bytes] = field(init=False, repr=False, compare=False)
    _digest: Callable[[bytes], bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.algo not in _FUNCTIONS:
            raise ConfigError(f"unknown prefix caching hash algo {self.algo!r}: one of {', '.join(ALGOS)}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be a positive number of tokens, got {self.block_size!r}")
        if self.hash_seed is None and self.algo in RANDOM_SEED_ALGOS:
            raise SeedUnknown(f"with {self.algo} and PYTHONHASHSEED unset, vLLM draws its first block's parent "
                              f"hash from a random seed per process: set PYTHONHASHSEED on the engine and give "
                              f"quilld the same value, or use sha256")
        serialize, digest = _FUNCTIONS[self.algo]  # derived fields of a frozen dataclass, set once here
        object.__setattr__(self, "_serialize", serialize)
        object.__setattr__(self, "_digest", digest)
        seed = DEFAULT_SEED if self.hash_seed is None else self.hash_seed
        object.__setattr__(self, "none_hash", EngineBlockHash(digest(serialize(seed))))

    def block_hashes(self, token_ids: Sequence[int], lora: Lora | None = None, cache_salt: str | None = None,
                     parent: EngineBlockHash | None = None) -> list[EngineBlockHash]:
        """The hashes of the full blocks of `token_ids` (Python ints), first to last, as the engine
        names them.

        `parent`: the hash of the block before `token_ids[0]` when they continue a prompt (then
        none of them is block 0, and `cache_salt` is not used).
        """
        serialize, digest, size = self._serialize, self._digest, self.block_size
        lora_key = None if lora is None else ("lora", _fresh(lora.name), _fresh(lora.path))
        later = None if lora_key is None else (lora_key,)
        first = later
        if parent is None and cache_salt:
            first = (*(later or ()), ("cache_salt", _fresh(cache_salt)))
        prev = bytes(self.none_hash if parent is None else parent)
        out: list[EngineBlockHash] = []
        for start in range(0, len(token_ids) - size + 1, size):
            extra = first if start == 0 else later
            prev = digest(serialize((prev, tuple(token_ids[start:start + size]), extra)))
            out.append(EngineBlockHash(prev))
        return out

    def event_extra_keys(self, blocks: int, lora: Lora | None = None, cache_salt: str | None = None,
                         first_block: bool = True) -> list[tuple[str, ...] | None] | None:
        """A BlockStored event's `extra_keys` for `blocks` blocks (`first_block`: the event's first is
        the prompt's block 0): each block's untagged LoRA name and salt, or None for a block with
        neither (vLLM's `to_event_extra_keys`); None for an event of no block."""
        later = None if lora is None else (lora.name,)
        first = (*(later or ()), cache_salt) if first_block and cache_salt else later
        return [first if i == 0 else later for i in range(blocks)] or None
