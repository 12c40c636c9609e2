"""The KV connector contract both sides import: the scheduler- and worker-side ABCs, their
per-step output, kv_transfer_config, kv_transfer_params, the roles, and Protocols for what they
read from the floors above. Implementations live in ``pagedkv.kv_transfer``."""
