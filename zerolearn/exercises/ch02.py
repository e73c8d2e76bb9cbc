"""Chapter 02's exercises."""
