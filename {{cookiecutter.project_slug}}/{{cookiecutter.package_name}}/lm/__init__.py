"""The language-model example: a small GPT (gpt.py, module.py) on bundled text (data.py)."""
