"""Storage tiers: the offset allocator and the DRAM arena (SSD tier to come)."""
