"""CuTe DSL kernels (no torch here): imported only where nvidia-cutlass-dsl is installed."""
