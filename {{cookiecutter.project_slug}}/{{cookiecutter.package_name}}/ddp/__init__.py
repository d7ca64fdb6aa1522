"""The template's machinery: DDP wiring, checks, fault handling, parity, the scaling doctor.

Your model and data never import DDP; a data module subclasses `GlobalBatchDataModule` (data.py) to get
the global batch, exact resume and exactly-once evaluation. Edit these files only to change the template.
"""

from .data import GlobalBatchDataModule

__all__ = ["GlobalBatchDataModule"]
