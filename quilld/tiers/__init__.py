"""Storage: the keyspace front door (keyspace.py), a block's life (block.py), two-phase puts
(puts.py), the offset allocator and DRAM arena, the tier seam (tier.py), the SSD tier
(ssd*.py, wal.py) and its policy (tiering.py). Storage never knows the wire."""
