# the built-in cost terms register themselves (term_registry.py) before any simulator module is used
from autopar.simulator.step import builtin_terms  # noqa: F401
