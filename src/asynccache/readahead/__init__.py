"""Read-ahead for synchronous consumers: the PyTorch pipe, the torchdata node, and what
they share per process."""
