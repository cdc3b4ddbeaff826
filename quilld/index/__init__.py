"""The control plane: residency index, KV events and their subscribers, engines, the router
(cost model), ROUTE request validation, hot prefixes, and the feed that mirrors this node's
own blocks into the index (control.py ties them together)."""
