"""Stores: bytes in, bytes out, per node; no namespaces, no objects."""
