"""`python -m ddpkit.tune`: hyperparameter search in which every trial is a DDP run (search.py)."""

from .search import main

if __name__ == "__main__":  # imported, as the library's tests import every module, it does nothing
    main()
