"""The model and what runs it: loading, the runtime of executors, preprocessing, GPU decode."""
