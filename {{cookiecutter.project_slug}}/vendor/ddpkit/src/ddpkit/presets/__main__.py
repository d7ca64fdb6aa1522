"""`python -m ddpkit.presets`: list the library's config presets, or copy some into configs/ (ddpkit.presets)."""

import sys

from . import main

if __name__ == "__main__":  # imported, as the library's tests import every module, it does nothing
    sys.exit(main())
