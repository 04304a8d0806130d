"""The pure core: the ``TableState`` pytree and the jit-able functions over it.

Nothing here touches threads, ctypes or a compiler: ``core`` imports only
JAX, NumPy and itself. The native CPU kernels (``funcreplay.native``) plug in
as an injected executor (``core.executor``); the host ``Table`` and the other
layers sit above and import from here, never the other way round.
"""
