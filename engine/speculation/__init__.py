"""Speculative decoding: its config, the proposers (draft model, n-gram) and the
Speculator that verifies their drafts in one target forward."""
