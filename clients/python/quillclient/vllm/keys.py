"""How a vLLM block is named in the pool: one rule for the tier and the connector.

vLLM 0.33 names a block by its prefix-cache hash (`BlockHash`, the digest bytes of
`hash_block_tokens`), the same hash its KV events publish. The pool keeps the block

- under the key `block_key(h, group)`: the lowercase hex of the digest for KV-cache group 0
  (so `redis-cli GET <hex>` finds it), and `<hex>.g<group>` for group 1 and up (the hybrid
  allocator's other groups hash the same tokens, so the group keeps their blocks apart);
- with `PUT2PHASE ... HASH index_hash(h) [PARENT index_hash(parent)]`, the low 64 bits of
  the digest read big-endian: exactly the integer vLLM's BlockStored events carry, so the
  residency index, ROUTE's pool credit and the gateway's handoff check count the block
  under the hash the engine itself reports.

vLLM's offloading layer packs a hash and its group into one `OffloadKey` (the digest and
the group as 4 bytes big-endian); `split_offload_key` undoes that.
"""

from __future__ import annotations

_U64 = (1 << 64) - 1
_GROUP_BYTES = 4  # vLLM 0.33 make_offload_key: group_idx.to_bytes(4, "big")


def block_key(block_hash: bytes, group: int = 0) -> str:
    """The pool key of a vLLM block: its digest in lowercase hex, `.g<group>` after it past group 0."""
    if not block_hash:
        raise ValueError("a vLLM block hash is never empty")
    if group < 0:
        raise ValueError(f"KV-cache group {group} is negative")
    hexed = bytes(block_hash).hex()
    return hexed if group == 0 else f"{hexed}.g{group}"


def index_hash(block_hash: bytes) -> int:
    """The block's hash as the residency index (and vLLM's int-form KV events) knows it."""
    return int.from_bytes(bytes(block_hash), "big") & _U64


def split_offload_key(offload_key: bytes) -> tuple[bytes, int]:
    """(block hash, group) of a vLLM `OffloadKey`."""
    raw = bytes(offload_key)
    if len(raw) <= _GROUP_BYTES:
        raise ValueError(f"an OffloadKey of {len(raw)} bytes holds no block hash")
    return raw[:-_GROUP_BYTES], int.from_bytes(raw[-_GROUP_BYTES:], "big")


def offload_block_key(offload_key: bytes) -> str:
    """The pool key of the block a vLLM `OffloadKey` names."""
    block_hash, group = split_offload_key(offload_key)
    return block_key(block_hash, group)
