"""The engine core shared by every engine: one scheduling policy (``Scheduler``), one KV block
manager (``KVManager``) and the per-request ``Sequence``. The mocker adds a timing model, the
PyTorch engine a model; both schedule and announce KV blocks the same way."""
