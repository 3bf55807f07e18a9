"""Running alongside a run: brokers jetsplit starts itself (embedded or a private
Mosquitto), live progress, Prometheus metrics, and TensorBoard / MLflow tracking."""
