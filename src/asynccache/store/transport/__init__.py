"""Connections: the pipelined blocking socket and the asyncio protocol every store uses."""
