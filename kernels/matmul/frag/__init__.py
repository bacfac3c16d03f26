"""The fragment layout (INT4 words laid out as tensor-core A fragments; Q4_K, Q5_K, Q6_K variants) and its Gluon
kernels."""
