"""The engine: requests, sampling parameters, the scheduler, LLMEngine and the offline LLM API."""
