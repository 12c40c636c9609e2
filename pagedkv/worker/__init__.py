"""The worker: the persistent input batch and the model runner (tensors here, no policy)."""
