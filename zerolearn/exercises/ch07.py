"""Chapter 07's exercises."""
