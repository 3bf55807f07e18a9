"""Server coordinator: fleet registry, rounds, algorithms, aggregation, metrics."""
