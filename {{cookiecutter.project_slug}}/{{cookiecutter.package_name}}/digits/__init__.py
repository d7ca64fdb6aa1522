"""The digits example: yours to replace. model.py (the network), module.py (the LightningModule), data.py (datasets)."""
