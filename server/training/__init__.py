"""How a run trains, whatever the engine: the trainer (exchanges with the fleet, cuts,
books, public reply checks), the round loop, the frozen settings, optimisers per tier,
each round's books, evaluation on held-out data, checkpoints, the divergence guard, and
where a step's tensors are placed (CPU or GPU, mixed precision)."""
