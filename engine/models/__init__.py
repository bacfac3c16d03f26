"""The model: decoder.py (one decoder for every supported family), layers.py (its small pieces), fused_decode.py
(the batch-1 decode layer with the norms folded into the INT4 matmuls)."""
