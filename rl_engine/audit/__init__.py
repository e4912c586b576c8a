"""The drift audit: ``rl-engine audit`` / ``python -m rl_engine.audit`` (docs/audit.md)."""
