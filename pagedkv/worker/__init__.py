"""The worker: the persistent input batch and the model runner (tensors live here, policy does not)."""
