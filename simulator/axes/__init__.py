"""One module per parallelism or technique, with its costs and memory: the twins of the
runtime's ``apply_*.py``."""
