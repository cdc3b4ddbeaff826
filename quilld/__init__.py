"""QuillCache: a distributed KV-cache pool and control plane for LLM serving."""

from quilld import native

__version__ = "0.1.0"

native.choose()  # compiled hot path or its .py sources, before any of them is imported (native.py)
