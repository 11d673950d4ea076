"""engram-llama in PyTorch: the reference model and the ``torch`` backend's model."""
