"""The quant-serve command: one module per subcommand, the engine and serve flags, the benchmarks it runs."""
