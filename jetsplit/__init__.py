"""jetsplit: split federated learning across fleets of NVIDIA Jetson devices over MQTT."""

__version__ = "0.1.0"
