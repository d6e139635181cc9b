"""The policy model server (upstream: ``responses_api_models/vllm_model``)."""

from .converter import ConversionError, chat_to_responses, responses_to_chat

__all__ = ["ConversionError", "chat_to_responses", "responses_to_chat"]
