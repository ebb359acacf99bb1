"""The model runner: the batch packed for the device each step, the compiled model and sampler
programs, penalties."""
