"""Plug-ins that feed kvprefetch from routers and agent frameworks: one module per framework."""
