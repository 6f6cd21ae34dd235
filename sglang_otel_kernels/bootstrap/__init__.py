"""The directory `sglang-otel-kernels run` puts first on PYTHONPATH; its
`sitecustomize` instruments each process at start-up."""
