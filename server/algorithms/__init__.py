"""Training methods written against the transport-neutral engine, and their pure math."""
