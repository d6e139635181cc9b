"""Tokenizer, chat template, tiny policy and the generation worker."""
