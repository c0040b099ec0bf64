"""The compute kernels: attention (the readable specification, the blockwise ring kernel in XLA ops, the
Pallas flash kernels for GPUs and TPUs) and the experts' grouped SwiGLU. train.py and sample.py reach them
through attention.py and grouped_swiglu.py."""
