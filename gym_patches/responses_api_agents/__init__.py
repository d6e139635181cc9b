"""Gym agent servers (upstream: ``responses_api_agents``): the model/tool loop
behind ``/run``, one implementation shared by the session agent and the
restart-only agent."""
