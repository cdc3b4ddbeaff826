"""The Redis-protocol side: the sans-IO RESP codec (resp.py), the asyncio server shell
(server.py), the command table and dispatcher (table.py), every command handler
(commands/), a connection's state (session.py), the open connections (clients.py) and
INFO's sections (info.py). The node's context and figures it shares with the HTTP front
ends live below both, in quilld/context/."""
