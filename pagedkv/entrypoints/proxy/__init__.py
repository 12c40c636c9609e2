"""The PD proxy: service discovery, routing and the OpenAI-compatible front end."""
