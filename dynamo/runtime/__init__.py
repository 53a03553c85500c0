"""Process plumbing: discovery, the request plane, the event plane, cancellation and errors."""
