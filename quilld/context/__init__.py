"""The node's shared context and its figures, below both front ends.

The RESP protocol (`quilld/protocol/`) and the HTTP front ends (`quilld/http/`) read the
same `NodeContext` (node_context.py) and the same figures (figures.py), so INFO,
`/v1/stats` and `/metrics` always agree; neither front end imports the other.
"""
