"""Chapter 03's exercises."""
