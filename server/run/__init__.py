"""The launchers: `server.toml` and its validation, the one run assembly every launcher
hands the round loop, `jetsplit server run`, `simulate`, `trial`, the shared [train] flags,
and the checks made before anything expensive starts."""
