"""Observation: the advice ledger, request outcomes, metrics and the dashboard timeline."""
