"""Benchmarks for kvprefetch: `kvprefetch bench ingest`, `kvprefetch bench memory` and the rest.

bench/README.md says how to run them; docs/data-science/performance.md has the numbers.
"""
