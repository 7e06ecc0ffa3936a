"""Job events over MQTT: the embedded broker, its settings and accounts, the topics, the publisher."""
