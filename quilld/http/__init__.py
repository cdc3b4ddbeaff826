"""HTTP surfaces: the admin API (admin.py) and the OpenAI-compatible gateway (gateway*.py)."""
