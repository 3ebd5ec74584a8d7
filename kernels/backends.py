"""The attention backends a config may name (``pdserve.kernels.dispatch`` says what each
runs). Apart from the kernels so that a config names one without importing torch."""

BACKENDS = ("auto", "torch", "native", "triton")
