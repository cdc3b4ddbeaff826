"""HTTP surfaces: the admin API (and, later, the OpenAI-compatible gateway)."""
