"""Command-line entry points: ``pagedkv generate | serve | proxy | bench``."""
