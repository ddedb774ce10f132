"""The `tokensampler` command line (`cli`): the benchmark (`bench*`) and `generate`."""
