"""MultiConnector: several KV connectors composed as one (vLLM's connector of connectors)."""
