"""Constrained decoding: grammars (llguidance) compiled per request, matched per step."""
