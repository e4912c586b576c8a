"""Test utilities shipped with the package: tolerance table, invariance checkers, tiny models."""
