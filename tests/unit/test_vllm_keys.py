"""The pool's names for vLLM blocks (quillclient/vllm/keys.py), and the package's lazy exports."""

import subprocess
import sys

import pytest

from quillclient.vllm import keys


def test_group_zero_is_the_bare_hex_and_other_groups_are_suffixed():
    h = bytes.fromhex("00ff10") + bytes(29)
    assert keys.block_key(h) == h.hex()
    assert keys.block_key(h, 2) == h.hex() + ".g2"
    with pytest.raises(ValueError):
        keys.block_key(b"")
    with pytest.raises(ValueError):
        keys.block_key(h, -1)


def test_index_hash_is_the_low_64_bits_big_endian_as_vllm_events_carry_them():
    h = bytes(range(32))
    assert keys.index_hash(h) == int.from_bytes(h[-8:], "big")
    assert keys.index_hash(b"\x01\x02") == 0x0102


def test_an_offload_key_splits_into_hash_and_group():
    h = bytes(range(32))
    assert keys.split_offload_key(h + (3).to_bytes(4, "big")) == (h, 3)
    assert keys.offload_block_key(h + bytes(4)) == h.hex()
    with pytest.raises(ValueError):
        keys.split_offload_key(b"\x00\x00\x00\x01")


def test_importing_the_package_imports_neither_vllm_nor_torch():
    code = ("import sys, quillclient, quillclient.vllm, quillclient.vllm.keys;"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
