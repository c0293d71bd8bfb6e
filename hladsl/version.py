"""The package version, in a leaf module so every layer may read it."""
__version__ = "0.1.0"
