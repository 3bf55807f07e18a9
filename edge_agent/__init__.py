"""Edge agent: the device side (MQTT session, block runtimes, profiler, local data)."""
