"""Speculative decoding on the worker: proposers (n-gram prompt lookup, a draft model) and the
rejection sampler that verifies their drafts in the target model's own forward."""
