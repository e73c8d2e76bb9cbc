"""Chapter 00's exercises."""
