"""What the cache tells about itself: counters, histograms, the stats board, the summary
line, Prometheus."""
