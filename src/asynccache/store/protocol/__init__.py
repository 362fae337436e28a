"""Wire protocols without I/O (the h11 shape): bytes to send, replies to interpret.

The asyncio connections (event loop) and the blocking connections (consumer threads)
both use these, so a protocol detail lives in exactly one place.
"""
