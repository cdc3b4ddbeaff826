"""Where a prefill engine's KV lands in the pool: the key scheme a disaggregated handoff relies on.

The gateway checks that a prefill's blocks are in the pool before it sends the decode
request, and pulls them toward the decode engine's node; for both it must find them.
An engine's connector stores block i of a prompt

- in the engine's identity scope: its `tenant` (the user its connector authenticates
  as), its `model` and `tokenizer`, and the request's LoRA adapter (empty for the base
  model), as `SCOPE model tokenizer [adapter]` sets it; the same scope the control plane
  gives the engine's own KV events (`ControlPlane.engine_tag`);
- under the key `kv_key(h)`: `kv:` and the 16 lowercase hex digits of the block's hash h
  as an unsigned 64-bit integer (`kv:00000000000003e9` for 1001);
- with `PUT2PHASE BEGIN key nbytes HASH h` (then DATA and COMMIT with its CRC32C), so that
  the residency index records the block under its hash on the node that holds it (the
  gateway's check reads the index, one lookup a block, never the keys). `PARENT p`, the hash
  of the block before, is optional: in a cluster it places the block in its prompt's segment
  of the directory (found in ROUTE's first round trip); without it the block heads a segment
  of its own and is found in the second (cluster/dir_link.py `block_holders`).

The hashes are quilld's own prompt block hashes (http/prompt_blocks.py): a prompt's token
ids chained `block_size` at a time (`chain_hashes`), or its rendered text in
`gateway.chunk_chars` pieces, as ROUTE and the gateway hash it.
"""

from __future__ import annotations

_U64 = (1 << 64) - 1


def kv_key(block_hash: int) -> bytes:
    """The pool key of the block whose hash is `block_hash`."""
    return b"kv:%016x" % (block_hash & _U64)
