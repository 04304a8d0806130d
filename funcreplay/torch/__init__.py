"""``funcreplay.torch``: the public name of the torch bridge (``funcreplay.interop.torch``).

  import funcreplay.torch as frt
"""

from funcreplay.interop.torch import *  # noqa: F401,F403 (the public re-export)
from funcreplay.interop.torch import __all__  # noqa: F401
