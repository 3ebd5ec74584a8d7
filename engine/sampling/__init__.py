"""Logits to tokens: the sampler, its top-k / top-p / min-p filters, the seeded
uniforms every draw uses, and the rejection sampler that verifies drafts."""
