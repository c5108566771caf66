"""outbox_ext benchmark harness (see bench/README.md)."""
