"""Generation backends. ``worker.GenerationWorker`` is the torch backend behind an OpenAI-style HTTP API."""
