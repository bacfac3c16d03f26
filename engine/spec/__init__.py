"""Speculative decoding: proposers (prompt lookup, a draft model), verification of the proposals in one forward of
the target model, and the acceptance rule that keeps the target's distribution exactly."""
