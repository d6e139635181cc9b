"""Named fakes: deterministic stand-ins a config selects by name, not tests.

``scripted_backend`` is an OpenAI-compatible chat-completions server that plays
scripted replies (``policy.model_name: scripted-test-backend`` on the RL side,
or a Gym model server pointed at it), so recovery can be exercised and measured
over real HTTP with answers known in advance.
"""
