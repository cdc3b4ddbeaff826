"""QuillCache: a distributed KV-cache pool and control plane for LLM serving."""

__version__ = "0.1.0"
