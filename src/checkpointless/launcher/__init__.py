"""launcher."""
