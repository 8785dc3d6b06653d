"""Speculative decoding: proposers (n-gram prompt lookup), the in-step rejection sampler,
and the settings parsed from vLLM's ``speculative_config`` dict."""
