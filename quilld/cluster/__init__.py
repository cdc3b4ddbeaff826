"""The cluster: membership, the sharded residency directory and peer transfer.

`cluster.py` is the node's side of it. Membership is SWIM + Lifeguard:
`swim.py` is the sans-IO state machine, `wire.py` its packet format,
`lifeguard.py` and `broadcast.py` its timers and retransmit queue, and
`gossip.py` the asyncio shell that moves its packets over UDP and TCP.
The directory: `ownership.py` (rendezvous owners of virtual buckets),
`dir_entries.py` (holders' and owners' entry stores), `directory.py` (one node's
part, sans-IO), `dir_link.py` (its asyncio shell and this node's lookups);
`simulation.py` and `sim_scenarios.py` drive the same code for a thousand
simulated nodes. Engines: `engine_table.py` (the table every node shares, merged
last-writer-wins) and `engines_sync.py` (its gossip, each engine's home, the load
summed over the nodes). Reads: `pool_reads.py`. Transfer: `transfer.py` routes
fetches over TCP (`peer_client.py`) or RDMA (`rdma.py`), with `fabric.py` the
shared seam.
"""
