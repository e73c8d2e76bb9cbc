"""Chapter 04's exercises."""
