"""Paged attention (decode, prefill, verification), the KV store, their merges, and the torch twins."""
