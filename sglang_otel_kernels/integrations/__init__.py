"""Recording kernels of other software without editing it: SGLang, and the
OpenTelemetry instrumentor that `opentelemetry-instrument` loads."""
