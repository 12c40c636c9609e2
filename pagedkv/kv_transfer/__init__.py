"""KV transfer between instances: the connector API, its registry and the connectors."""
