"""Decisions: the advisor, the scheduler and their loops, route estimates and hints."""
