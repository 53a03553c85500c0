"""The event plane: topic-based publish/subscribe between processes."""
