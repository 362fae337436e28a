"""Redis and Valkey, one server or a cluster."""
