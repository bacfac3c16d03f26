"""The linear layers a model is built from: INT4 (QuantLinear), dense, 8-bit codes, merged layers of mixed parts."""
