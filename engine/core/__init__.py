"""The scheduling core, plain Python: scheduler, KV block ids of both tiers and the prefix cache, sequences, request
checks, detokenizer."""
