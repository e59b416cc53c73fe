"""The package version: a leaf, so any module can name it without importing the package's root."""

__version__ = "0.1.0"
