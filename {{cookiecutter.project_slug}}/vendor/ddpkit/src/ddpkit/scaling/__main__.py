"""`python -m ddpkit.scaling`: the scaling sweep, its preflight and `--explain` (sweeper.py)."""

from .sweeper import main

if __name__ == "__main__":  # imported, as the library's tests import every module, it does nothing
    main()
