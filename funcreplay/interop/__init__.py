"""Bridges to other frameworks (``interop.torch``; public name ``funcreplay.torch``)."""
