"""The cluster: membership, residency replication and peer transfer.

`cluster.py` is the node's side of it. Membership is SWIM + Lifeguard:
`swim.py` is the sans-IO state machine, `wire.py` its packet format,
`lifeguard.py` and `broadcast.py` its timers and retransmit queue, and
`gossip.py` the asyncio shell that moves its packets over UDP and TCP.
Replication: `replog.py` (this node's log), `follower.py` and `directory.py`
(peers' logs, followed). Transfer: `transfer.py` routes fetches over TCP
(`peer_client.py`) or RDMA (`rdma.py`), with `fabric.py` the shared seam.
"""
