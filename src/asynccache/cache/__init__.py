"""The object cache: ``AsyncKVCache`` and the mechanisms it is made of, in one event loop."""
