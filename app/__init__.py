"""kvprefetch: predictive KV-cache prefetching for LLM serving fleets."""

__version__ = "0.1.0"
