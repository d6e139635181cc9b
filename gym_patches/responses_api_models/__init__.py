"""Model servers (upstream: ``nemo_gym`` ``responses_api_models/``): a Responses
API front end over an OpenAI-compatible chat-completions backend."""
