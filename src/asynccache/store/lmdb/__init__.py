"""LMDB: a store on one machine, with no server."""
