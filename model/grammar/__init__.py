"""Structured output (docs/spec.md 12): grammars compiled by llguidance, and the host side of constrained
decoding on a rank (the frontier's allowed tokens, checked canvases)."""
