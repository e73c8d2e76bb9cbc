"""Chapter 05's exercises."""
