"""Where each device's model is cut, and how a fleet of cuts trains: the planned cuts per
device, the coordinator's completion copies for shallower devices, live re-planning between
rounds, and shipping each device the bundle for its cut."""
