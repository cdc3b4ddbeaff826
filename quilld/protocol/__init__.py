"""The Redis-protocol side: the sans-IO RESP codec (resp.py), the asyncio server shell
(server.py), the command table and dispatcher (table.py), every command handler
(commands/), the handler context (context.py, session.py), the open connections
(clients.py) and the node's figures for INFO and the admin API (info.py)."""
