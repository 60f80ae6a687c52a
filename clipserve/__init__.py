"""clipserve: an async inference server for CLIP embeddings with its own dynamic batcher."""

__version__ = "0.1.0"
