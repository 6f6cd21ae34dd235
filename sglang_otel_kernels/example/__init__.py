"""An example serving process: a tiny model of decorated kernels behind HTTP."""
