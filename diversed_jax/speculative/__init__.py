"""Speculative decoding: verification rules, the jitted speculative loop, drafts."""
