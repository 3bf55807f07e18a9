"""What protects a run from devices that lie or go quiet: the rules that combine uploads
(FedAvg's mean and the robust aggregators), the per-step bounds on activations, losses and
gradients, the size claims' caps, the label and update-direction checks, sitting out after
missed deadlines, reading untrusted numbers, and what all of them remember across a resume.
`defences.Defences` owns their state and is what a method calls on the data path."""
