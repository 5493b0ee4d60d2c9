"""elastic: elastic PyTorch training on mixed spot and on-demand clusters, built on Ray."""

__version__ = "0.1.0"
