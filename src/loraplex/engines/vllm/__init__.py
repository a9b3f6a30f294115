"""vLLM's AsyncLLM behind loraplex's engine interface: the GPU data plane."""
