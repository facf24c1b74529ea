"""Benchmarks for kvprefetch: `kvprefetch bench ingest` and `kvprefetch bench memory` (see README.md)."""
