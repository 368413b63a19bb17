"""`colibri-stream bench`: every contender side by side under one memory limit (suite.py runs the sections)."""
