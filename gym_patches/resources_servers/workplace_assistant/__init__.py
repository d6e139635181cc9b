"""HTTP server over the office world (upstream: ``resources_servers/workplace_assistant``)."""
