"""The package's error for bad input, importable without torch."""


class ConfigError(ValueError):
    """Bad input, detected before any work starts (the CLIs exit with code 2)."""
