"""plain_loop_agent: the same loop without boundaries; a restart-only agent."""
