"""Test module added by the basic bundle."""
ADDED = 1
