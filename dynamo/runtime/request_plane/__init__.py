"""The request plane: how a request reaches an instance and how its responses stream back."""
