"""Chapter 01's exercises."""
