"""The engines behind the server: `native` (loraplex's own, the default) and `vllm`."""
