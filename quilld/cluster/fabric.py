"""What every transfer path shares: the seam's types and the RDMA device description.

`Transfer` is the interface transfer.py routes fetches through; `RdmaInfo`
is one RDMA port as advertised in gossip meta. Both transfer.py and rdma.py
import this module, and neither imports pyverbs here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from quilld.model import IdentityScope

MTU_MIN, MTU_MAX = 1, 5  # enum ibv_mtu: IBV_MTU_256 .. IBV_MTU_4096
_GID_RE = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){7}$")
ZERO_GID = ":".join(["0000"] * 8)


@dataclass(frozen=True)
class RdmaInfo:
    """One RDMA port this node can use, as advertised in gossip meta (gid_index stays local)."""

    device: str
    port: int
    lid: int
    gid: str  # 'xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx:xxxx'
    mtu: int  # enum ibv_mtu (1..5), not bytes
    link_layer: str  # "ib" or "eth" (RoCE); the two cannot talk to each other
    gid_index: int = 0

    def to_meta(self) -> dict:
        return {"dev": self.device, "port": self.port, "lid": self.lid, "gid": self.gid,
                "mtu": self.mtu, "ll": self.link_layer}

    @classmethod
    def from_meta(cls, m: Any) -> RdmaInfo | None:
        """The device a peer advertises, or None when it advertises none or nothing valid."""
        if type(m) is not dict:
            return None
        dev, port, lid, gid, mtu, ll = (m.get(k) for k in ("dev", "port", "lid", "gid", "mtu", "ll"))
        if type(dev) is not str or not dev or type(gid) is not str or not _GID_RE.match(gid):
            return None
        if not (type(port) is int and 1 <= port <= 255 and type(lid) is int and 0 <= lid <= 0xFFFF):
            return None
        if not (type(mtu) is int and MTU_MIN <= mtu <= MTU_MAX and ll in ("ib", "eth")):
            return None
        if ll == "eth" and gid == ZERO_GID or ll == "ib" and lid == 0 and gid == ZERO_GID:
            return None  # no address to reach it by
        return cls(dev, port, lid, gid, mtu, ll)



Target = Callable[[int], memoryview]
Fetched = tuple[int | None, memoryview | None, int]  # (crc32c, view, expires at: unix ms or -1)


class Transfer(Protocol):
    """One way of reading a peer's block into memory that `target(length)` names.

    Returns (crc32c the peer computed, the view written, when the key expires
    there: unix ms, or -1) or (None, None, -1) when the peer no longer has the
    key; raises QuillError (PeerError) on failure. The caller verifies the CRC.
    """

    name: str

    async def fetch_into(self, peer: str, addr: tuple[str, int], scope: IdentityScope, key: bytes,
                         target: Target) -> Fetched: ...

    def close(self) -> None: ...
