"""Test helpers that run as real processes (nothing here is used in production)."""
