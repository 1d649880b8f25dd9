"""One module per fact a PASS rests on (see each module's docstring); the entry (judge/entry.py) lists them."""
