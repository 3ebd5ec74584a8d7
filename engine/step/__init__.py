"""The step: the scheduler picks what each request computes, the model runner runs the
forward over its persistent batch, the output stage makes tokens into deltas and text."""
