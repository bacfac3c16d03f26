"""Accuracy evaluation: perplexity, KL divergence, tasks, report, gate. Imports engine, quant."""
