"""memcached, one server or a pool."""
