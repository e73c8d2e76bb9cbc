"""Chapter 06's exercises."""
