"""Cluster membership: SWIM + Lifeguard failure detection and gossip.

`swim.py` is the sans-IO state machine, `wire.py` its packet format,
`lifeguard.py` and `broadcast.py` its timers and retransmit queue, and
`gossip.py` the asyncio shell that moves its packets over UDP and TCP.
"""
