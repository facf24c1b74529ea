"""Benchmarks for kvprefetch: `kvprefetch bench ingest` and `kvprefetch bench memory` (see bench/README.md and docs/data-science/performance.md)."""
