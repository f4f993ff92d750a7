"""Sampling on the device: the sampler (greedy, temperature / top-k / top-p / min-p, logprobs) and per-request
logits processing (penalties, logit bias, min_tokens, grammar bitmasks). The runner samples with it, speculative
decoding's verification draws from it."""
