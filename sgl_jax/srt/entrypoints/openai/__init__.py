"""The OpenAI-compatible API: request/response models and the completions and chat routes.

``protocol`` holds the pydantic bodies; ``serving_completions`` and ``serving_chat`` turn a
request into one batch for the shared TokenizerManager and its outputs into OpenAI responses.
"""
