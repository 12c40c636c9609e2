"""Executors: what runs the model for the engine, on one rank or on N tensor-parallel ranks."""
