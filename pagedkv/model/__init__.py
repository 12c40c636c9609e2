"""Model configs, safetensors loading, the Llama family and the sampler.

Import from the modules (``pagedkv.model.sampler``, ``pagedkv.model.config``, ...): this package
imports nothing itself, so light modules such as ``generation_config`` stay free of torch."""
