"""The shared job queue on NATS JetStream: names every deployable agrees on, the client."""
