"""A store provider written the way a third party would: public names of asynccache only."""
