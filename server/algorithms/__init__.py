"""Training methods written against the transport-neutral engine, and their pure math."""

# The registry (methods.py) imports the methods defined in other modules, which subclass its
# `Method`; loading it first keeps that cycle in one order, whichever module is asked for.
from jetsplit.server.algorithms import methods as _methods  # noqa: E402, F401
