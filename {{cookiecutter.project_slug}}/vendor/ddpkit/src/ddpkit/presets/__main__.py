"""`python -m ddpkit.presets`: list the library's config presets, or copy some into configs/ (ddpkit.presets)."""

import sys

from . import main

sys.exit(main())
