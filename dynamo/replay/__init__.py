"""Offline replay: a whole deployment (the live routers' code, the mocker scheduler) on a
virtual clock; and the capacity planner built on it (``dynamo replay``, ``dynamo plan``)."""
