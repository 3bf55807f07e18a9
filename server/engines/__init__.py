"""How the coordinator reaches its devices: the engine seam (`Command` in, `Outcome` out)
that methods are written against, the in-process engine that runs real workers in this
process, the MQTT engine that reaches them through a broker, and the registry of who is
online, busy or gone. Both engines give bit-identical weights."""
