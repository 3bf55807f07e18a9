"""The devices as a fleet: per-round books of every agent, live speed and link estimates,
SHeRL-FL's edge topology, provisioning (fleet CA, startup kits, broker ACL) and the
`jetsplit fleet` commands."""
