"""The package version (``funcreplay.__version__``; written into checkpoint headers)."""

VERSION = "0.1.0"
