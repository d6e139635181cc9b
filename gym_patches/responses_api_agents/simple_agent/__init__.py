"""simple_agent: the session agent; its runs park at loop boundaries and are saved."""
