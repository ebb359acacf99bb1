"""Structured outputs: what a request asks its output to match, and the token masks that enforce it."""
