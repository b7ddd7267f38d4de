"""Developer tools (not used at serving time)."""
