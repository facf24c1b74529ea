"""Ingestion: the event log, the ingestor and the backlog of what it observed."""
