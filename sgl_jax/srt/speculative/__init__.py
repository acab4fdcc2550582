"""Speculative decoding: draft proposers and the acceptance rule of a verify step."""
