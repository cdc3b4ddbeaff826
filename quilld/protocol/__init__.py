"""RESP codec (sans-IO), the asyncio server shell and the command table."""
