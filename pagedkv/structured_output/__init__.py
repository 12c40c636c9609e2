"""Structured outputs: grammars compiled by llguidance constrain what a request may sample.

The engine compiles a request's grammar when the request is made (cached by grammar), keeps one
matcher per request, fills a packed token bitmask for the rows that sample each step, and
advances each matcher by the tokens sampled. The worker applies the bitmask inside the batched
sampler. No torch here: the bitmask is numpy (one bit per token, 32 tokens per int32 word).
"""
